"""Run on every rank by torchrun: the measured idle share of 1F1B, ZB-H1 and interleaved 1F1B
on 4 ranks, with the stages' compute padded to known times.

4 gloo ranks on 2 shared cores time-share them: a rank waiting on a peer is often waiting for
the core that peer computes on, so the idle share of real compute would measure the OS
scheduler, not the pipeline schedule. Here each compute action runs the real pass, then sleeps
to a fixed duration (``PaddedTrainer``; a sleep releases the core), so the ranks behave like 4
devices whose stages take equal, known times. With ``u`` = ``--unit`` seconds, a stage of 1/4 of
the layers takes ``u`` per forward and ``2 u`` per backward (under ZB-H1 ``u`` for the input
gradient and ``u`` for the weight gradient: the shares ``schedules.BACKWARD_SHARE`` and
``WEIGHT_SHARE`` the schedule model assumes); a stage of interleaved 1F1B (1/8 of the layers,
2 chunks per rank) half of that. The send / receive between actions and the Python around them
are not padded: they count as idle, as on real devices.

Each schedule trains an 8-layer MLP (4 stages, or 8 stages in 2 chunks per rank) on
``--microbatches`` microbatches with ``report=True``-style timing (``StepTimer``): ``--warmup``
untimed steps, then ``--steps`` timed ones. Rank 0 writes per schedule the report record
(``bubble``: the plan's predicted and the measured share), the stage count, the chunks and the
padded time of one stage and microbatch (forward + backward, seconds).
"""
import argparse
import copy
import sys
import time
from contextlib import contextmanager

import torch

from alpa_lite import load_plan
from alpa_lite.core.capture import capture
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.runtime.pipeline import PipelineTrainer
from alpa_lite.runtime.report import StepTimer
from pipeline_sync import build, plan_all
from single_process import finish

LAYERS, ROWS = 8, 8  # MLP layers; rows per microbatch
STAGES = {"1f1b": 4, "zb-h1": 4, "interleaved": 8}


class PaddedTrainer(PipelineTrainer):
    """A ``PipelineTrainer`` whose compute actions last ``pad[kind]`` seconds: the pass, then a
    sleep for the rest (none when the pass took longer)."""

    pad: dict[str, float]  # kind -> seconds, set before the first step

    @contextmanager
    def _compute(self, kind: str):
        with super()._compute(kind):
            t0 = time.perf_counter()
            yield
            time.sleep(max(0.0, self.pad[kind] - (time.perf_counter() - t0)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--unit", type=float, default=0.1, help="padded forward seconds of a 1/4 stage")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(120)
    b = args.microbatches
    case = {"model": "mlp", "batch": ROWS * b, "build": {"num_layers": LAYERS, "hidden": 16}}
    cases = {name: case | {"plan": {"num_stages": s, "num_layers": LAYERS, "num_microbatches": b, "schedule": name}}
             for name, s in STAGES.items()}
    plans = plan_all(cases)
    model, example = build(case)
    captured = capture(model, tuple(x[:ROWS] for x in example))
    results = {}
    for name, stages in STAGES.items():
        plan = load_plan(plans[name])
        u = args.unit * 4 / stages
        split = name == "zb-h1"
        trainer = PaddedTrainer(copy.deepcopy(model), captured, plan, lambda p: torch.optim.SGD(p, lr=1e-3))
        trainer.pad = {"forward": u, "backward": u if split else 2 * u, "weight": u}
        trainer.timer = StepTimer(args.warmup)
        for _ in range(args.warmup + args.steps):
            trainer.step(*example)
        results[name] = {"record": trainer.report(name=name, show=False), "num_stages": stages,
                         "chunks": plan.chunks, "stage_seconds": 3 * u, "num_microbatches": b}
    finish(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
