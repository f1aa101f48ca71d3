"""Op families. Importing this package registers every op in the `graphsafe` namespace.

Each subpackage is one family (`cache`, `ragged`, `indexer`, `mla`, `attention`, ...);
its `__init__.py` registers the ops with `register_op` and holds their docstrings. The
families are discovered, so adding one needs no edit here; the public op functions are
re-exported from this package (`graphsafe.ops.<name>`, also `graphsafe.<name>`).
"""

import importlib
import pkgutil

from graphsafe.registry import REGISTRY


def families() -> list[str]:
    """The op families: the subpackages of `graphsafe.ops`."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


for _module in families():
    importlib.import_module(f"{__name__}.{_module}")

__all__ = sorted(REGISTRY.ops)
for _name, _spec in REGISTRY.ops.items():
    globals()[_name] = _spec.public
