"""SPMD runtime: execute a ``Plan`` on real processes (``parallelize``)."""
from .init import init_parameters
from .trainer import ParallelTrainer, collective_counts, device_mesh, parallelize

__all__ = ["ParallelTrainer", "collective_counts", "device_mesh", "init_parameters", "parallelize"]
