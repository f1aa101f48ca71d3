"""The README's promises: its commands are what CI runs, and its example runs."""

from __future__ import annotations

import pathlib
import re

import pytest

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


def test_readme_example_runs_with_public_names_only(capsys):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    private = re.findall(r"^\s*(?:from|import) (graphsafe\S*\._\w+)", code, re.M)
    assert not private, f"the README example imports private modules: {private}"
    code = code.replace('new_registry("my_lib")', 'new_registry("my_lib_readme_test")')
    exec(compile(code, "README.md", "exec"), {})
    # The example's bad call is refused under torch.compile with the eager message.
    assert "my_lib.scaled_add: argument 'y' must be of the shape of x [4], got [5]" in capsys.readouterr().out


def test_package_ships_py_typed_and_license():
    assert (ROOT / "graphsafe" / "py.typed").is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license-files = ["LICENSE"]' in pyproject and '"py.typed"' in pyproject


def test_version_flag():
    import subprocess
    import sys

    import graphsafe

    out = subprocess.run([sys.executable, "-m", "graphsafe", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"graphsafe {graphsafe.__version__} "), out
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{graphsafe.__version__}"' in pyproject


def test_ci_installs_bounded_versions():
    """A release elsewhere cannot turn CI red: every package the CPU set-up installs is pinned."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "scripts/constraints.txt" in setup
    pins = [line.split("#")[0].strip() for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines()]
    pins = [p for p in pins if p]
    names = {re.split(r"[=<>!~]", p)[0].lower() for p in pins}
    for package in ("triton", "numpy", "hypothesis", "pytest", "transformers"):
        assert package in names, f"{package} is not pinned in scripts/constraints.txt"
    assert all("==" in p for p in pins), pins


def test_performance_page_is_generated_from_the_results():
    """docs/performance.md is what benchmarks/performance_page.py makes of the bench JSON in
    benchmarks/results (a new result without a regenerated page fails here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("performance_page", ROOT / "benchmarks" / "performance_page.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    assert page.main(["--check"]) == 0, "run: python benchmarks/performance_page.py"
    text = (ROOT / "docs" / "performance.md").read_text()
    for image in re.findall(r"\]\((img/[^)]+)\)", text):
        assert (ROOT / "docs" / image).is_file(), image


def test_performance_page_takes_each_shape_from_its_newest_run():
    """A newer run of a few shapes of a case (the variants' bench reports the ops' own cases)
    replaces those shapes only; the others stay from the older run; the table shows
    graphsafe's own other paths (the Triton kernel) beside the peers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("performance_page", ROOT / "benchmarks" / "performance_page.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)

    def run(started, rows):
        return {"meta": {"started": started}, "rows": [{"case": "op", "shape": shape, "impl": impl, "median_ms": ms}
                                                       for shape, impl, ms in rows]}

    old = run("2026-01-01", [("a", "graphsafe[triton]", 1.0), ("a", "graphsafe triton kernel", 2.0),
                             ("b", "graphsafe[triton]", 3.0)])
    new = run("2026-01-02", [("b", "graphsafe[triton]", 4.0), ("b", "flashinfer x", 2.0)])
    files, docs, rows = page.newest_per_case([("new.json", new), ("old.json", old)])["op"]
    assert files == ["old.json", "new.json"] and set(docs) == {"old.json", "new.json"}
    assert [(r["shape"], r["median_ms"]) for r in rows if r["impl"] == "graphsafe[triton]"] == [("a", 1.0), ("b", 4.0)]
    lines, points = page.case_table(rows)
    assert [p["peers"] for p in points] == [{"graphsafe triton kernel": 2.0}, {"flashinfer x": 2.0}]


def test_docs_are_linked_from_the_readme_and_cited_design_exists():
    assert "docs/design.md" in README and "docs/performance.md" in README
    assert (ROOT / "docs" / "design.md").is_file()


def _probe_output(compile_for_sm90, name: str) -> str:
    """The output of benchmarks/<name> (a Gluon probe that compiles for sm_90 on the CPU),
    run in the subprocess that compiles for sm_90; skips where this Triton has no Gluon."""
    probe = ROOT / "benchmarks" / name
    script = (
        "import runpy\n"
        "try:\n"
        f"    runpy.run_path({str(probe)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('OK')\n"
    )
    out = compile_for_sm90(script, timeout=600)
    if "NO_GLUON" in out:
        pytest.skip("this Triton has no Gluon or no CUDA backend")
    return out


def test_gluon_cluster_probe_runs(compile_for_sm90):
    """benchmarks/gluon_cluster_probe.py (the evidence of benchmarks/NOTES.md on clusters in
    Gluon) still runs with this Triton: its control kernel, a tile split over a 2-CTA
    cluster with no exchange, compiles for sm_90, and every case prints a verdict."""
    out = _probe_output(compile_for_sm90, "gluon_cluster_probe.py")
    assert re.search(r"^split +compiles", out, re.M), out
    for case in ("split_to_whole", "rows_to_columns"):
        assert re.search(rf"^{case} +(compiles|does not compile)", out, re.M), out


def test_gluon_tile_shape_probe_runs(compile_for_sm90):
    """benchmarks/gluon_tile_shape_probe.py (the evidence of benchmarks/NOTES.md on 48-key
    tiles) still runs with this Triton: its power-of-two controls compile for sm_90 and
    every width prints a verdict."""
    out = _probe_output(compile_for_sm90, "gluon_tile_shape_probe.py")
    for n in (16, 32, 64):
        assert re.search(rf"^N +{n} compiles", out, re.M), out
    for n in (24, 48):
        assert re.search(rf"^N +{n} (compiles|does not compile)", out, re.M), out


def test_gluon_cache_hint_probe_runs(compile_for_sm90):
    """benchmarks/gluon_cache_hint_probe.py (the evidence of benchmarks/NOTES.md on L2 cache
    hints in Gluon) still runs with this Triton: its control, a TMA copy with no hint, compiles
    for sm_90 with no hint in its PTX, and the hinted copies each print a verdict."""
    out = _probe_output(compile_for_sm90, "gluon_cache_hint_probe.py")
    assert re.search(r"^tma +compiles; PTX: 1 copy instruction\(s\), L2::cache_hint 0", out, re.M), out
    assert re.search(r"^tma_evict_first +(compiles|not expressible|does not compile)", out, re.M), out
    assert re.search(r"^cp_async_evict_last +(compiles|does not compile)", out, re.M), out


def test_profile_peers_picks_impls_and_needs_a_gpu(capsys):
    """benchmarks/profile_peers.py (Nsight's driver for the peer comparisons in
    benchmarks/NOTES.md): `--impl` texts pick impls by substring, none picks every impl but
    the PyTorch reference rows; off a GPU it says so and profiles nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_peers", ROOT / "benchmarks" / "profile_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.chosen("graphsafe[triton]", ["graphsafe[", "flashmla"])
    assert module.chosen("flashmla sparse decode", ["graphsafe[", "flashmla"])
    assert not module.chosen("graphsafe triton kernel", ["graphsafe[", "fa3"])
    assert module.chosen("flashinfer MLA fa3", None) and not module.chosen("reference compiled", None)
    if not module.torch.cuda.is_available():
        assert module.main(["--case", "sparse_mla"]) == 0
        assert "needs a GPU" in capsys.readouterr().out
