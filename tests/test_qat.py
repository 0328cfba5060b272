"""Quantization-aware training on the kernels: the FP8 state QDQ kernel and the w_quantizer path.

CPU: the kernels run under ``TRITON_INTERPRET=1`` (conftest.py) at tiny sizes. The QDQ
kernel equals the reference bit for bit (values, scales, fake-quantized state); the
public functions take the kernel ops (backend ``"triton"``) and match the references,
gradients included. The GPU runs of the same checks: ``tests/test_qat_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

import kdn_compile
from kdn_compile.reference.fp8 import quantize_state_fp8, state_fp8_qdq_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                   reason="needs CUDA or TRITON_INTERPRET=1")


def fp8_states(shape, block_v, dtype, device="cpu", seed=0) -> torch.Tensor:
    """Random states whose columns span 15 decades, with an all-zero first tile in the first
    matrix (scale 1), a ``-0.0`` and values that round to zero in E4M3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-12, 3, shape[-1])
    x = x.reshape(-1, *shape[-2:])
    x[0, :, :block_v] = 0.0
    x[-1, 0, -1] = -0.0
    return x.reshape(shape).to(device=device, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``-0.0 != +0.0``), dtypes included."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


QDQ_SHAPES = [
    # shape [..., K, V], block_v
    pytest.param((3, 2, 16, 40), 16, id="partial-last-tile"),
    pytest.param((2, 5, 7), 3, id="odd-sizes"),
    pytest.param((2, 70, 130), 64, id="tile-larger-than-registers"),
    pytest.param((9, 12), 64, id="one-tile-wider-than-V"),
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,block_v", QDQ_SHAPES)
def test_qdq_kernel_is_the_reference_bit_for_bit(shape, block_v, dtype):
    """Values and scales of quantize_state_fp8 and the QDQ of state_fp8_qdq_reference.
    (bfloat16: on the GPU, the interpreter truncates float32 to bfloat16.)"""
    from kdn_compile.lowering.fp8 import state_fp8_qdq_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = fp8_states(shape, block_v, dtype, device)
    values, scales = state_fp8_qdq_fwd(x, block_v, split=True)
    expected_values, expected_scales = quantize_state_fp8(x, block_v)
    assert same_bits(values, expected_values)
    assert same_bits(scales, expected_scales)
    assert scales.reshape(-1)[0] == 1.0, "all-zero tile"
    assert same_bits(state_fp8_qdq_fwd(x, block_v), state_fp8_qdq_reference(x, block_v))


@needs_kernels
def test_state_fp8_qdq_takes_the_kernel_and_passes_gradients_through(monkeypatch):
    from kdn_compile.ops import fp8 as fp8_ops

    calls = []
    real = fp8_ops.state_fp8_qdq_fwd
    monkeypatch.setattr(fp8_ops, "state_fp8_qdq_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = fp8_states((2, 3, 8, 20), 8, torch.float32).requires_grad_()
    with kdn_compile.use_backend("triton"):
        y = kdn_compile.state_fp8_qdq(x, 8)
    assert calls == [1]
    assert same_bits(y.detach(), state_fp8_qdq_reference(x.detach(), 8))
    grad = torch.randn_like(x)
    y.backward(grad)
    assert torch.equal(x.grad, grad), "straight-through"


def test_state_qdq_kernel_path_traces_as_on_the_gpu():
    """``kdn::chunk_gdn`` with FP8 state QDQ on its kernel branch, traced on the CPU
    (tests/_trace_kernel_path.py) through AOTAutograd's min-cut partitioner with the float8
    chunk states among its saved outputs: two forward launches (prepare, recurrence) and two
    backward ones (no recomputed states)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "tests/_trace_kernel_path.py", "gdn-qdq"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0 and "counts [2, 2]" in done.stdout, (
        done.stdout + done.stderr[-3000:])
