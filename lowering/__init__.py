"""Triton kernels and their launchers: how each ``kdn`` op lowers on the GPU.

Installed as ``kdn_compile.lowering``. Launchers call ``wrap_triton(kernel)[grid]``
so that ``torch.compile``, Inductor and AOTInductor see every kernel; they read
no tensor values on the host.
"""
