"""alpa-lite: Alpa-style automatic parallelization of PyTorch training.

``plan(model, example_inputs, mesh)`` finds the intra-operator sharding plan (Zheng et al.,
"Alpa", OSDI 2022, section 4) for a ``LogicalMesh``, or a pipelined plan (section 5); ``Plan``
holds it. ``parallelize(model, mesh, example_inputs)`` runs one on the ranks of a torchrun job;
``verify(model, inputs, mesh)`` checks that a plan trains like one process.
The layers (``core``, ``compiler``, ``runtime``, ``tools``, ``zoo``): ``docs/architecture.md``.
"""
from .api import parallelize, plan
from .compiler.ilp import MemoryBudgetError
from .core.capture import CaptureError
from .core.mesh import PRESETS, ClusterSpec, LogicalMesh, get_cluster
from .core.options import PipelineOptions, PlanOptions
from .core.plan import PipelinePlan, Plan, PlanError, load_plan
from .core.spec import ShardingSpec
from .runtime.init import init_parameters

__all__ = ["CaptureError", "ClusterSpec", "LogicalMesh", "MemoryBudgetError", "PRESETS", "PipelineOptions", "PipelinePlan",
           "Plan", "PlanError", "PlanOptions", "ShardingSpec", "VerifyReport", "get_cluster", "init_parameters",
           "load_plan", "parallelize", "plan", "verify"]


def __getattr__(name: str):
    """``verify`` and ``VerifyReport`` load on first use: the verify ranks run
    ``python -m alpa_lite.tools.verify``, which runpy warns about when the package has already
    imported that module."""
    if name in ("verify", "VerifyReport"):
        from .tools import verify as module
        return getattr(module, name)
    raise AttributeError(f"module 'alpa_lite' has no attribute {name!r}")
