"""The README's promises: its commands are what CI runs, and its example runs."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", README, re.S)]


def test_readme_gives_the_main_job_and_the_test_command():
    blocks = _bash_blocks()
    assert any("python -m graphsafe" in b and "scripts/setup.sh" in b for b in blocks)
    assert any("pytest" in b and "scripts/setup.sh" in b for b in blocks)


def test_ci_runs_the_readme_test_command():
    test_command = next(b for b in _bash_blocks() if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines(), ".ci/run must call the README's test command verbatim"
    assert "set -euo pipefail" in ci, "a failing (or empty, exit 5) pytest run must fail CI"


def test_setup_pins_the_cpu_torch_build():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '"torch==2.13.0"' in setup


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    code = code.replace('new_registry("my_lib")', 'new_registry("my_lib_readme_test")')
    exec(compile(code, "README.md", "exec"), {})
