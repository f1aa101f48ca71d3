"""scripts/setup.sh where torch already exists in another environment, with no package
index: the GPU image's case (its `python3` is a venv's interpreter holding torch, and the
machine has no network). The script must reuse that torch, install nothing, and leave a
.venv that imports it and this repository's graphsafe."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What the script reads: itself, its helper, the project's metadata, the package.
COPIED = ("scripts", "graphsafe", "pyproject.toml", "README.md", "LICENSE")
MODULES = ("torch", "numpy", "hypothesis", "pytest", "xdist", "execnet", "triton", "transformers")


def _dir_of(module: str) -> str:
    mod = __import__(module)
    return str(pathlib.Path(mod.__file__).resolve().parents[1 if mod.__file__.endswith("__init__.py") else 0])


def _torch_venv(tmp_path: pathlib.Path) -> pathlib.Path:
    """Venv A: no pip, and the packages of this test's interpreter (torch, the test
    extras, transformers) through a .pth file, without graphsafe: an environment that has
    torch and everything graphsafe needs but graphsafe itself."""
    venv = tmp_path / "torch_env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dirs = list(dict.fromkeys(_dir_of(m) for m in MODULES))
    (pathlib.Path(site) / "lent_packages.pth").write_text("\n".join(dirs) + "\n")
    probe = subprocess.run([str(python), "-I", "-c", "import importlib.util as u\n"
                            f"print([m for m in {MODULES!r} + ('graphsafe',) if u.find_spec(m)])"],
                           capture_output=True, text=True, cwd=tmp_path)
    if probe.stdout.strip() != repr(list(MODULES)):
        pytest.skip(f"cannot lend this interpreter's packages without graphsafe: {probe.stdout}{probe.stderr}")
    return python


def _repo_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    repo = tmp_path / "repo"
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, repo / name)
    return repo


def _offline_env(python: pathlib.Path) -> dict[str, str]:
    """No index pip could reach, no pip configuration (find-links, extra indexes), no
    PYTHONPATH: only what the environments hold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), PIP_NO_INDEX="1", PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
               PIP_TIMEOUT="1", PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1")
    return env


def _run_setup(repo: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def torch_env_and_repo(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    return _torch_venv(tmp_path), _repo_copy(tmp_path)


def test_setup_reuses_torch_of_another_venv_offline(torch_env_and_repo):
    python, repo = torch_env_and_repo
    env = _offline_env(python)
    first = _run_setup(repo, env)
    assert first.returncode == 0, first.stdout + first.stderr
    venv_python = repo / ".venv" / "bin" / "python"
    probe = subprocess.run(
        [str(venv_python), "-c", "import os, torch, graphsafe, pytest, xdist, transformers\n"
         "print(os.path.realpath(torch.__file__)); print(os.path.realpath(graphsafe.__file__))"],
        cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    torch_file, graphsafe_file = probe.stdout.split()
    import torch

    assert torch_file == os.path.realpath(torch.__file__), "the .venv imports the other environment's torch"
    assert graphsafe_file == str((repo / "graphsafe" / "__init__.py").resolve()), "and the repository's graphsafe"
    site = pathlib.Path(subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    assert not (site / "torch").exists() and not list(site.glob("torch-*")), "no second torch in .venv"
    assert f"with torch {torch.__version__} from" in first.stdout, first.stdout
    # Idempotent: a second run (the README's second command) changes nothing and passes.
    pth = sorted((p.name, p.read_text()) for p in site.glob("graphsafe_*.pth"))
    again = _run_setup(repo, env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted((p.name, p.read_text()) for p in site.glob("graphsafe_*.pth")) == pth


def test_setup_names_what_it_lacks_offline(torch_env_and_repo):
    """A requirement the environment does not satisfy, no index: a failure that names the
    requirement and the ways out, and still no second torch."""
    python, repo = torch_env_and_repo
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('oracle = ["transformers>=5.17"]',
                                                       'oracle = ["transformers>=99"]'))
    out = _run_setup(repo, _offline_env(python))
    assert out.returncode != 0
    assert "transformers>=99  # found" in out.stderr, out.stderr
    assert "network" in out.stderr and "find-links" in out.stderr, out.stderr
    assert not list((repo / ".venv").glob("lib/*/site-packages/torch")), "no torch installed"
