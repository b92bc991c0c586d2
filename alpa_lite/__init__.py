"""alpa-lite: Alpa-style automatic parallelization of PyTorch training.

``plan(model, example_inputs, mesh)`` finds the intra-operator sharding plan (Zheng et al.,
"Alpa", OSDI 2022, section 4) for a ``LogicalMesh``; ``Plan`` holds it. ``parallelize(model,
mesh, example_inputs)`` runs one as SPMD training on the ranks of a torchrun job.
"""
from .core.capture import CaptureError
from .compiler.ilp import MemoryBudgetError
from .core.mesh import PRESETS, ClusterSpec, LogicalMesh, get_cluster
from .core.plan import Plan, PlanError
from .compiler.planner import plan
from .runtime import parallelize
from .core.spec import ShardingSpec

__all__ = ["CaptureError", "ClusterSpec", "LogicalMesh", "MemoryBudgetError", "PRESETS", "Plan", "PlanError",
           "ShardingSpec", "get_cluster", "parallelize", "plan"]
