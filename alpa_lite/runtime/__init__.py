"""The runtime: execute a ``Plan`` on real processes (SPMD and pipelined); reads ``core`` only."""
from .init import init_parameters
from .trainer import ParallelTrainer, collective_counts, device_mesh

__all__ = ["ParallelTrainer", "collective_counts", "device_mesh", "init_parameters"]
