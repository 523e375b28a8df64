"""The parts of the CPU backend's tuning (:class:`gateway.backend.CpuTuning`), for MLX on
the CPU (``mlx[cpu]``: Docker, CI, Linux servers): each replaces one of MLX's own paths
where a measurement here finds it faster (:mod:`gateway.cpu.measure`)."""
