"""Test set-up: Triton's interpreter on CPU-only machines, hypothesis profiles, markers."""

import os

import torch

# Must happen before triton is imported anywhere: on a machine without a GPU the Triton
# backends are tested through the interpreter (small shapes only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("GRAPHSAFE_MAX_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
    print_blob=True,
)
settings.load_profile(os.environ.get("GRAPHSAFE_HYPOTHESIS_PROFILE", "default"))

HAS_CUDA = torch.cuda.is_available()

if os.environ.get("TRITON_INTERPRET") == "1":
    # Nested @triton.jit calls without the interpreter's redundant re-patching (same
    # semantics; graphsafe/testing/interpreter.py says why and where it applies).
    from graphsafe.testing.interpreter import install as _install_interpreter_shortcut

    _install_interpreter_shortcut()


def _runs_long(item) -> bool:
    """The few tests that take most of a CPU run: the top-k and DSv4 ops' contract checks
    through Triton's interpreter and the sm_90 compiles."""
    if "compile_for_sm90" in getattr(item, "fixturenames", ()):
        return True
    return (item.nodeid.startswith("tests/test_contract.py") and "-triton]" in item.nodeid
            and ("top_k_per_row" in item.nodeid or "[dsv4_" in item.nodeid))


def pytest_collection_modifyitems(config, items):
    from graphsafe.testing.contract import nonfinite_warning_filters

    # Long tests first (stable otherwise): pytest-xdist hands tests out in this order, so
    # the workers end together instead of one running a long test alone at the end.
    items.sort(key=lambda item: not _runs_long(item))

    skip_gpu = pytest.mark.skip(reason="needs a CUDA/HIP device")
    # Tests that feed NaN or inf on purpose: the numpy warnings of Triton's interpreter
    # about them are expected there (and only there).
    nonfinite = pytest.mark.filterwarnings(*nonfinite_warning_filters())
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "nonfinite" in item.keywords:
            item.add_marker(nonfinite)


@pytest.fixture(autouse=True)
def _fresh_backend_choice_and_workspace():
    """Every test starts from automatic backend selection and fresh workspace arenas
    (a graph captured by one test must not pin the arena of the next)."""
    import graphsafe
    from graphsafe.workspace import reset_workspace_managers

    with graphsafe.use_backend(None):
        yield
    if HAS_CUDA:
        torch.cuda.synchronize()
    reset_workspace_managers()


@pytest.fixture
def compile_for_sm90():
    """Run a script that compiles Triton kernels for sm_90 (no GPU needed: Triton's whole
    pipeline and ptxas run on the CPU) in a fresh interpreter without TRITON_INTERPRET,
    and return its stdout. The script prints NO_BACKEND when this triton build cannot
    target CUDA (the test is skipped) and ends with OK when every kernel compiled."""
    import pathlib
    import subprocess
    import sys

    def run(script: str, timeout: int = 600) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = str(pathlib.Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
        if "NO_BACKEND" in proc.stdout:
            pytest.skip("this triton build cannot compile for CUDA")
        assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout

    return run


AITER_STANDIN_DIR = os.path.join(os.path.dirname(__file__), "aiter_standin")
_AITER_ADAPTERS = ("graphsafe.ops.mla.aiter", "graphsafe.ops.attention.aiter", "graphsafe.ops.indexer.aiter",
                   "graphsafe.ops.topk.aiter")


def _purge_aiter_modules():
    import sys

    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        del sys.modules[name]


def _clear_adapter_caches():
    """The adapters' functools caches (aiter functions and types they looked up)."""
    import importlib

    for module_name in _AITER_ADAPTERS:
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


@pytest.fixture
def aiter_standin(monkeypatch):
    """`aiter = aiter_standin("gfx942")`: the stand-in aiter package (tests/aiter_standin)
    imported as `aiter` for that architecture (and `version`, the release it calls itself:
    default the pinned commit's), graphsafe's architecture probe answering it; the
    adapters' caches are cleared before and after, the modules removed after."""
    import graphsafe.backends
    import graphsafe.device_info

    if not graphsafe.backends.triton_interpreter_enabled():
        pytest.skip("the adapters' Triton kernels run on the stand-in's CPU tensors through Triton's interpreter")

    def install(arch: str, version: str | None = None):
        monkeypatch.setenv("AITER_STANDIN_ARCH", arch)
        if version is None:
            monkeypatch.delenv("AITER_STANDIN_VERSION", raising=False)
        else:
            monkeypatch.setenv("AITER_STANDIN_VERSION", version)
        monkeypatch.syspath_prepend(AITER_STANDIN_DIR)
        _purge_aiter_modules()
        _clear_adapter_caches()
        import aiter

        assert aiter.__file__.startswith(AITER_STANDIN_DIR), aiter.__file__
        monkeypatch.setattr(graphsafe.device_info, "rocm_arch", lambda device=None: arch)
        monkeypatch.setattr(graphsafe.device_info, "num_sms", lambda device=None: aiter.get_cu_num())
        return aiter

    yield install
    _purge_aiter_modules()
    _clear_adapter_caches()
