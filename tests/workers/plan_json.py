"""Plans gpt-tiny (2 blocks) on a 2x2 A100 description and prints the plans' JSON, one per line:
the intra-op plan at 1.1x its least memory (an ILP that does not close at its root node) and a
2-stage pipelined plan (tests/test_determinism.py runs it under several
``PYTHONHASHSEED``)."""
import json

from alpa_lite import LogicalMesh, plan
from alpa_lite.compiler.ilp import MemoryBudgetError
from alpa_lite.zoo.models import build_model

model, example = build_model("gpt-tiny", 8, 16, device="meta", num_layers=2)
mesh = LogicalMesh((2, 2), cluster="a100")
try:
    plan(model, example, mesh, memory_budget=1.0)
except MemoryBudgetError as least:
    budget = least.minimum_bytes * 1.1
for kw in ({"memory_budget": budget}, {"pipeline": 2}):  # the node limit, never the wall clock, may stop them
    print(json.dumps(plan(model, example, mesh, time_limit=3600, **kw).to_json()))
