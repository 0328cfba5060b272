"""Without Triton (macOS, Windows, a bare CPU install) the package imports and every
op runs its reference, eagerly and under ``torch.compile``.

Runs in a child process whose import system refuses ``triton``.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, importlib.abc

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoTriton())
import torch
import kdn_compile
from kdn_compile.layers import KimiDeltaAttention
from kdn_compile.ops import _dispatch

assert not _dispatch.TRITON
torch.manual_seed(0)
layer = KimiDeltaAttention(32, 2, 16, chunk_size=8).double()
x = torch.randn(1, 20, 32, dtype=torch.float64, requires_grad=True)
y, _ = layer(x)
(dx,) = torch.autograd.grad(y.sum(), x)
compiled = torch.compile(lambda t: layer(t)[0], fullgraph=True, backend="aot_eager")
yc = compiled(x)
(dxc,) = torch.autograd.grad(yc.sum(), x)
assert torch.allclose(y, yc) and torch.allclose(dx, dxc)
assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
print("ok")
"""


def test_imports_and_runs_references_without_triton():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
