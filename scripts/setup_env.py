"""Helpers of scripts/setup.sh (standard library only; run by the interpreter named).

    python scripts/setup_env.py paths      the directories of packages this interpreter sees
                                           (its sys.path less the standard library and
                                           PYTHONPATH), one a line: setup.sh lists them in
                                           .venv's site-packages so that .venv sees the same
                                           torch, whatever environment holds it
    python scripts/setup_env.py missing    the requirements of pyproject.toml (dependencies,
                                           the test and oracle extras) that this interpreter
                                           does not satisfy, as a pip requirements file (a
                                           comment gives the version found; empty: all there)
    python scripts/setup_env.py site       this interpreter's site-packages (purelib)
    python scripts/setup_env.py torch      "VERSION PATH" of the torch this interpreter would
                                           import (found, not imported: fast), or nothing
"""

from __future__ import annotations

import os
import pathlib
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXTRAS = ("test", "oracle")


def package_paths() -> list[str]:
    """sys.path entries that hold installed packages: the environment's site-packages,
    what its .pth files add, the user site; not the standard library, not the current
    directory, not PYTHONPATH (the caller's environment passes that on by itself)."""
    std = [os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")]
    from_env = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    here = {os.path.realpath(p) for p in (os.getcwd(), ROOT, pathlib.Path(__file__).parent)}
    out: list[str] = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        site_dir = os.path.basename(real) in ("site-packages", "dist-packages")
        in_std = any(real == s or real.startswith(s + os.sep) for s in std)
        if real in from_env or real in here or (in_std and not site_dir):
            continue
        if real not in out:
            out.append(real)
    return out


def torch_here() -> str:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return ""
    try:
        from importlib import metadata

        version = metadata.version("torch")
    except Exception:  # noqa: BLE001 - no distribution metadata (a source tree): ask torch itself
        import torch

        version = torch.__version__
    return f"{version} {os.path.realpath(spec.origin)}"


def _toml(path: pathlib.Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip's vendored copy
        from pip._vendor import tomli as tomllib
    return tomllib.loads(path.read_text())


def requirements() -> list[str]:
    project = _toml(ROOT / "pyproject.toml")["project"]
    reqs = list(project.get("dependencies", ()))
    for extra in EXTRAS:
        reqs += project.get("optional-dependencies", {}).get(extra, ())
    return list(dict.fromkeys(reqs))


def missing() -> list[str]:
    """The requirements no installed distribution satisfies (name, version, markers)."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            Requirement = None
    out = []
    for text in requirements():
        if Requirement is None:  # no parser here: presence only
            name = text.split(";")[0].strip()
            for sep in "<>=!~[ ":
                name = name.split(sep)[0]
            try:
                metadata.version(name)
            except metadata.PackageNotFoundError:
                out.append(text)
            continue
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(text)
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{text}  # found {version}")
    return out


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else ""
    if command == "paths":
        print("\n".join(package_paths()))
    elif command == "missing":
        print("\n".join(missing()))
    elif command == "torch":
        print(torch_here())
    elif command == "site":
        print(sysconfig.get_paths()["purelib"])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
