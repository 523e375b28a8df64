"""The parts of the CPU backend's tuning (:class:`gateway.backend.CpuTuning`), for MLX on
the CPU (``mlx[cpu]``: Docker, CI, Linux servers), each chosen by a measurement
(:mod:`gateway.cpu.measure`):

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
- :mod:`gateway.cpu.merges`: a decode batch's merge of row caches over two streams.
"""
