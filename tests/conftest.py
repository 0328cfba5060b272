"""Test session set-up.

Without CUDA the Triton kernels run in the interpreter: ``TRITON_INTERPRET``
must be set before any kernel module is imported (``@triton.jit`` reads it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
