"""alpa-lite: Alpa-style automatic parallelization of PyTorch training.

``plan(model, example_inputs, mesh)`` finds the intra-operator sharding plan (Zheng et al.,
"Alpa", OSDI 2022, section 4) for a ``LogicalMesh``; ``Plan`` holds it. ``parallelize(model,
mesh, example_inputs)`` runs one as SPMD training on the ranks of a torchrun job.
``verify(model, inputs, mesh)`` checks that a plan trains like one process.
"""
from .capture import CaptureError
from .ilp import MemoryBudgetError
from .mesh import PRESETS, ClusterSpec, LogicalMesh, get_cluster
from .plan import Plan, PlanError
from .planner import plan
from .runtime import parallelize
from .spec import ShardingSpec
from .verify import VerifyReport, verify

__all__ = ["CaptureError", "ClusterSpec", "LogicalMesh", "MemoryBudgetError", "PRESETS", "Plan", "PlanError",
           "ShardingSpec", "VerifyReport", "get_cluster", "parallelize", "plan", "verify"]
