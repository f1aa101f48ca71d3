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


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/HIP device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


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
