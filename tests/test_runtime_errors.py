"""Bad input to the runtime gives a clear error, never a hang."""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from alpa_lite import parallelize
from alpa_lite.runtime.launch import torchrun
from alpa_lite.zoo.models import build_model

WORKER = str(Path(__file__).parent / "workers" / "bad_input.py")


def test_bad_input_errors(tmp_path):
    out = tmp_path / "errors.json"
    assert torchrun([WORKER, "--case", "errors", "--out", str(out)], nproc=4, timeout_s=300) == 0
    errors = json.loads(out.read_text())
    assert errors["mesh-size"].startswith("ValueError: mesh 2x4 has 8 devices but the world size is 4")
    assert errors["other-model"].startswith("PlanError: the plan was made for another model")
    assert errors["other-mesh"].startswith("PlanError: the plan is for a 1x4 mesh, the device mesh is 2x2")
    assert errors["corrupt-plan"].startswith("PlanError: plan JSON is corrupt")
    assert errors["bad-batch"].startswith("ValueError: input") and "the plan was made for (8, 16)" in errors["bad-batch"]


def test_rank_that_raises_ends_the_job_without_waiting_out_the_timeout(tmp_path):
    # a pipeline stage's rank raises between steps while the others wait in the next step: it
    # leaves at once (no exit barrier, which waited the whole collective timeout, here 120 s), and
    # the launcher ends the others
    log, raised = tmp_path / "log.txt", tmp_path / "raised"
    with open(log, "w") as f:
        code = torchrun([WORKER, "--case", "raising-rank", "--out", str(raised)], nproc=4, timeout_s=240,
                        stdout=f, stderr=subprocess.STDOUT)
    ended = time.time()
    assert code != 0
    assert "rank 1 fails on purpose" in log.read_text()
    assert ended - float(raised.read_text()) < 60  # 14 s measured under a load of 60, < 10 s on a quiet machine


def test_dead_rank_fails_fast_and_is_named(tmp_path):
    log, died = tmp_path / "log.txt", tmp_path / "died"
    with open(log, "w") as f:
        code = torchrun([WORKER, "--case", "dead-rank", "--out", str(died)], nproc=4, timeout_s=240,
                        stdout=f, stderr=subprocess.STDOUT)
    ended = time.time()
    text = log.read_text()
    assert code != 0
    assert ended - float(died.read_text()) < 60  # the collective timeout is 15 s; no hang
    # torchrun's failure summary names the rank that died and its exit code
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*3", text), text[-3000:]


def test_parameter_frozen_after_planning_is_named(tmp_path):
    """A parameter frozen after the plan was made (the plan syncs its gradient) is refused at the
    step that reads it, naming its shape: on one rank, where every operand arrives in the spec it
    is read in and the interpreter skips ``reshard`` (``executor.Dispatch.checks``)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, example = build_model("mlp", 8, hidden=16, num_layers=2, device="cpu")
        trainer = parallelize(model, (1, 1), example, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        trainer.step(*example)
        trainer.params["layers.0.weight"].requires_grad_(False)
        with pytest.raises(RuntimeError, match=re.escape("plan and autograd disagree on whether a (16, 16) tensor "
                                                         "needs a gradient (plan: True)")):
            trainer.step(*example)
    finally:
        dist.destroy_process_group()
