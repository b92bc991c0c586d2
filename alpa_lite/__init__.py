"""alpa-lite: Alpa-style automatic parallelization of PyTorch training.

``plan(model, example_inputs, mesh)`` finds the intra-operator sharding plan (Zheng et al.,
"Alpa", OSDI 2022, section 4) for a ``LogicalMesh``, or a pipelined plan (section 5); ``Plan``
holds it. ``parallelize(model, mesh, example_inputs)`` runs one on the ranks of a torchrun job.
The layers (``core``, ``compiler``, ``runtime``, ``tools``, ``zoo``): ``docs/architecture.md``.
"""
from .api import parallelize, plan
from .compiler.ilp import MemoryBudgetError
from .core.capture import CaptureError
from .core.mesh import PRESETS, ClusterSpec, LogicalMesh, get_cluster
from .core.plan import Plan, PlanError
from .core.spec import ShardingSpec
from .runtime.init import init_parameters

__all__ = ["CaptureError", "ClusterSpec", "LogicalMesh", "MemoryBudgetError", "PRESETS", "Plan", "PlanError",
           "ShardingSpec", "get_cluster", "init_parameters", "parallelize", "plan"]
