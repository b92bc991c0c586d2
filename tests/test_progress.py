"""The planning progress display: every phase the planner reports, with its seconds, on a
terminal; nothing when the console is not one."""
import io
import re

import torch
import torch.nn as nn
from rich.console import Console

from alpa_lite import LogicalMesh, plan
from alpa_lite.tools.progress import PlanProgress


def _plan(progress, **pipeline):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    x = torch.zeros(8, 16, device="meta")
    return plan(model, (x,), LogicalMesh((1, 2), cluster="unit"), loss_fn=lambda out: out.sum(), progress=progress,
                **pipeline)


def _printed(terminal: bool, **pipeline) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200, color_system=None)
    with PlanProgress(console) as progress:
        _plan(progress, **pipeline)
    return out.getvalue()


def test_terminal_shows_each_phase_with_its_time():
    lines = [re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", line).strip() for line in _printed(True).splitlines()]
    done = [line for line in lines if line.startswith(("done", "planned"))]
    assert [re.sub(r" [0-9.]+ s$", "", line) for line in done] == [
        "done capturing the model (torch.export)", "done enumerating sharding strategies",
        "done solving the intra-op ILP", "planned in"]


def test_pipeline_phases_name_every_submesh():
    """Each submesh whose stage costs are computed is named: under ``"auto"`` the whole model on
    the whole mesh (priced first; on this tiny model it bounds out every other pair), with two
    stages forced the ranges on 1x1."""
    auto = _printed(True, pipeline="auto", num_microbatches=2, workers=1)
    two = _printed(True, pipeline=2, num_microbatches=2, workers=1)
    for text, phases in ((auto, ("capture (microbatch 4, B=2)", "stage costs on submesh 1x2 (the whole model, one stage)",
                                 "stage DP (B=2)", "stage plans")),
                         (two, ("stage costs on submesh 1x1 (9 layer ranges)", "stage DP (B=2)", "stage plans"))):
        for phase in phases:
            assert f"done {phase}" in text, phase


def test_quiet_when_not_a_terminal():
    assert _printed(False) == ""
