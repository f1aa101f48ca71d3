"""Op families. Importing this package registers every op in the `graphsafe` namespace."""

from graphsafe.ops.cache import concat_and_cache_mla, reshape_and_cache
from graphsafe.ops.ragged import build_ragged_indices_from_dense

__all__ = ["build_ragged_indices_from_dense", "concat_and_cache_mla", "reshape_and_cache"]
