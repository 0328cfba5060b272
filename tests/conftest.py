"""Test suite set-up: the tiers, the CUDA skip, seeds and global state.

Tiers (markers registered here, the only place that knows them):

* ``gpu``: the test runs our Triton kernels on CUDA and belongs to the GPU tiers;
  without CUDA it is skipped, unless it is also marked ``interpreter`` and the
  kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below without CUDA
  before any kernel module is imported: ``@triton.jit`` reads it).
* ``slow``: a GPU test of the full tier only (long shapes, AOTInductor packages,
  multi-rank emulation, model integrations). The smoke tier is ``gpu and not slow``.
* The full tier's groups, one marker each, given to every ``gpu`` test by its file
  (:data:`GROUPS`): each group fits one GPU call.

``./dev.sh gpu smoke|full|<group>`` runs them (docs/testing.md). Randomized tests take
the ``seed`` fixture: a fresh seed per run, ``KDN_TEST_SEED`` to replay one, and the
seed printed with any failure. Every test leaves the numerics switches (TF32, matmul
precision, the default dtype) and kdn_compile's backend and debug mode as it found them.
"""

import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from _helpers import interpreting  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Child processes started by tests import this checkout's kdn_compile (and the tests'
# helpers) whether or not the package is installed.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")) if p)

GROUPS = {
    "kernels": ("test_gdn_kernels.py", "test_two_key_kernels.py", "test_two_key_ops.py",
                "test_kalman_gain_kernels.py", "test_numerics_gpu.py", "test_qat_gpu.py",
                "test_decode_gpu.py", "test_invariance_gpu.py", "test_checkpoints_gpu.py"),
    "capture": ("test_gpu_capture.py", "test_errors_gpu.py", "test_serving_layers_gpu.py",
                "test_fla_calls.py", "test_docs_gpu.py"),
    "distributed": ("test_distributed_gpu.py",),
    "models": ("test_transformers_integration.py",),
}
_GROUP_OF = {name: group for group, files in GROUPS.items() for name in files}
SEED_VARIABLE = "KDN_TEST_SEED"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs the Triton kernels on CUDA (a GPU tier test; "
                            "skipped without CUDA unless also marked interpreter)")
    config.addinivalue_line("markers", "interpreter: without CUDA, runs its kernels in Triton's "
                            "interpreter")
    config.addinivalue_line("markers", "slow: a GPU test of the full tier only")
    for group, files in GROUPS.items():
        config.addinivalue_line("markers", f"{group}: full-tier GPU group ({', '.join(files)})")


def pytest_collection_modifyitems(config, items):
    interpreted = interpreting()
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        group = _GROUP_OF.get(os.path.basename(str(item.fspath)))
        if group is not None:
            item.add_marker(getattr(pytest.mark, group))
        if not CUDA and not (interpreted and item.get_closest_marker("interpreter")):
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed (``KDN_TEST_SEED`` replays one), printed if the test fails."""
    value = os.environ.get(SEED_VARIABLE)
    if value and not value.isdigit():
        raise pytest.UsageError(f"{SEED_VARIABLE} must be a non-negative integer, got {value!r}")
    value = int(value) if value else int.from_bytes(os.urandom(4), "little")
    request.node.kdn_seed = value
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    value = getattr(item, "kdn_seed", None)
    if value is not None and report.failed:
        report.sections.append(
            ("seed", f"seed {value}; replay: {SEED_VARIABLE}={value} pytest '{item.nodeid}'"))


def _switches():
    import kdn_compile

    cuda = torch.backends.cuda.matmul
    return (cuda.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
            torch.get_default_dtype(), kdn_compile.get_backend(), kdn_compile.get_debug())


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Put back the numerics switches and kdn_compile's modes a test changed."""
    import kdn_compile

    before = _switches()
    yield
    if _switches() == before:
        return
    tf32, cudnn_tf32, precision, dtype, backend, debug = before
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    torch.set_float32_matmul_precision(precision)
    torch.set_default_dtype(dtype)
    kdn_compile.set_backend(backend)
    kdn_compile.set_debug(debug)


@pytest.fixture(autouse=True)
def _kernel_bounds():
    """In the interpreter, fail a test whose kernels load or store outside their buffers."""
    if not interpreting():
        yield
        return
    try:
        import triton.runtime.interpreter  # noqa: F401
    except ImportError:  # the package runs without Triton (references only)
        yield
        return
    from _bounds import VIOLATIONS, install
    from _interpreter import install as install_speedups

    install()
    install_speedups()
    before = len(VIOLATIONS)
    yield
    found = VIOLATIONS[before:]
    assert not found, f"kernel accesses outside their buffers: {found[:5]}"

