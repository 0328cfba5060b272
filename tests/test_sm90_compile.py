"""Every Triton kernel compiles for sm_90 (H100/H200) with Inductor's argument types.

Inductor declares a Python float kernel argument as ``fp64`` (eager launches use
``fp32``); a kernel that mixes such a scalar into a loop-carried fp32 value fails to
compile only under ``torch.compile``. ``tests/_sm90_compile.py`` records the launches of
every kernel through the op layer, fixed length and packed, and compiles them with
Triton's CUDA backend, which needs no GPU. It runs in a subprocess because ``TRITON_INTERPRET`` (set for the other
CPU tests) replaces the JIT functions that the compiler needs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import without_interpreter

triton = pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90_as_inductor_types_it(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = without_interpreter()
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, every run
    script = Path(__file__).with_name("_sm90_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=900)
    report = done.stdout + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert "44 kernels, 0 failed" in done.stdout, report
    # no launch, fixed length or packed, is seen writing cu_seqlens or chunk indices
    # (lowering/_launch.py says why)
    assert "0 kernels write index tensors" in done.stdout, report
