"""aiter/_version.py: the version setuptools_scm writes at build (stand-in: AITER_STANDIN_VERSION).

The default is what a build of the pinned commit (v0.1.20-46-ge4048607a5) calls itself.
`at_least(release)` is the stand-in's own test (not aiter's): the rules that changed
between releases (csrc/py_itfs_cu/asm_mla.cu's lse flag in v0.1.19, the OPUS varlen kernel
in v0.1.18) follow it, so a test can install an older aiter."""

import os
import re

__version__ = os.environ.get("AITER_STANDIN_VERSION", "0.1.21.dev46+ge4048607a5")


def at_least(release: str) -> bool:
    """Whether `__version__` is `release` or later (a .dev / rc build of `release` is not)."""
    match = re.match(r"v?(\d+(?:\.\d+)*)(.*)", __version__)
    have = tuple(int(x) for x in match.group(1).split("."))
    want = tuple(int(x) for x in release.split("."))
    if have != want:
        return have > want
    return "dev" not in match.group(2) and "rc" not in match.group(2)
