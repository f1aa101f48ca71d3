"""A CPU stand-in for AMD's aiter, for graphsafe's adapter tests (no AMD GPU in CI).

It mirrors aiter at v0.1.20-46-ge4048607a5 (ROCm/aiter commit
e4048607a535ace3a2b51ded31b1c8c2d45c0879): the module paths, names, argument lists and
defaults of the functions graphsafe's `aiter` backend calls, and the checks aiter makes
on them (Python asserts, the C++ AITER_CHECK / TORCH_CHECK conditions, the dtype table
its pybind conversion applies, the kernels each architecture ships), so that a call
aiter would reject fails here too. Results come from plain PyTorch with aiter's
documented semantics, including where they differ from graphsafe's (e.g. an LSE aiter
leaves unwritten is filled with NaN here, so an adapter that returned it would fail).

What aiter would do out of bounds (read an unchecked block id, write past a cache) is an
error here: on a GPU it would be undefined behaviour.

The architecture is `AITER_STANDIN_ARCH` ("gfx942" or "gfx950", read at import, as aiter
reads rocminfo at import) and the version `AITER_STANDIN_VERSION` (`aiter/_version.py`,
which setuptools_scm writes at build; default: the pinned commit's); tests install the
package with the `aiter_standin` fixture. Like aiter's, this `__init__` exports no
`__version__`.
"""

from aiter import mla  # noqa: F401
from aiter.jit.utils.chip_info import get_cu_num, get_gfx  # noqa: F401
from aiter.ops.mha import *  # noqa: F401,F403
from aiter.ops.topk import *  # noqa: F401,F403
from aiter.utility import dtypes  # noqa: F401
