"""Pytest plugin for GPU runs: synchronize after every Triton launch and name the kernel.

An illegal memory access in a kernel surfaces at some later CUDA call and poisons
the process, so every later test fails with it too. With ``-p sync_launches``
(``benchmarks/`` on ``PYTHONPATH``) each ``wrap_triton`` launch of
``kdn_compile.lowering`` is followed by ``torch.cuda.synchronize()``, and a failure
there is re-raised naming the kernel, its grid and its constexprs. Used by
``gpu_suite.sh``, which also runs each test in its own process.
"""

from __future__ import annotations

import pytest
import torch


def _syncing(wrap_triton):
    def wrap(kernel):
        launcher = wrap_triton(kernel)

        class Launch:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    found = launcher[grid](*args, **kwargs)
                    if torch.cuda.is_available():
                        try:
                            torch.cuda.synchronize()
                        except Exception as e:
                            consts = {k: v for k, v in kwargs.items() if k.isupper()}
                            raise RuntimeError(
                                f"CUDA error in {kernel.fn.__name__} grid={grid} {consts}") from e
                    return found
                return run

        return Launch()
    return wrap


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    from _helpers import launcher_modules  # tests/ is on sys.path once tests are collected

    for module in launcher_modules():
        monkeypatch.setattr(module, "wrap_triton", _syncing(module.wrap_triton))
    yield
