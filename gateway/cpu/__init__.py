"""Linux CPU backend tuning: what ``mlx-gateway serve`` sets up when MLX runs on the CPU
(``mlx[cpu]``: Docker, CI, Linux servers). On a Mac MLX runs on Metal and none of it applies.

- :mod:`gateway.cpu.blas`: matmuls on the system OpenBLAS instead of the bundled
  reference BLAS.
- :mod:`gateway.cpu.weights`: quantized and half-precision weights as float32, whose
  matmuls go to BLAS.
- :mod:`gateway.cpu.allocator`: glibc malloc keeps freed buffers for reuse instead of
  returning them to the kernel, so large activations stop page-faulting.
- :mod:`gateway.cpu.idle_trim`: that kept memory goes back to the kernel once the engine
  has been idle for a while.
- :mod:`gateway.cpu.attention`: attention whose softmax ``exp`` runs as one compiled,
  vectorizable kernel instead of MLX's scalar CPU ``exp``.
"""

from __future__ import annotations


def cpu_backend() -> bool:
    """True when MLX computes on the CPU: neither Metal nor CUDA is available."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return not (mx.metal.is_available() or (cuda is not None and cuda.is_available()))
