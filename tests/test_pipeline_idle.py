"""The measured idle share of the pipeline schedules on 4 gloo ranks (one launch).

ZB-H1 (Qi et al., ICLR'24) and interleaved 1F1B (Narayanan et al., SC'21, 2 chunks per rank)
must idle less than 1F1B on the same 4 ranks, model and microbatches, and each as much as the
schedule model predicts for its stage times (``bubble_fraction``): 1F1B ``3/7``, ZB-H1 ``1/5``,
interleaved ``3/11`` with 4 device groups and B = 4.

What is measured: the trainer's report (``runtime/report.py``): per rank the seconds in forward,
backward and weight passes against the step's schedule time. On 2 shared cores the 4 ranks'
real compute time-shares the cores, so the worker (tests/workers/pipeline_idle.py) pads every
compute action to a fixed duration with a sleep, which frees the core: the ranks then behave
like 4 devices with equal stages of known times (forward 100 ms, backward 200 ms per 1/4 of the
model), and the idle share depends on the schedule, not on the OS scheduler. Transfers and the
Python between actions are not padded: they count as idle, as they would on devices; measured
on this machine they add 1 to 2 points to the prediction (2 to 4, up to 8 under load, with 30 ms
forwards: docs/pipeline.md), hence the tolerance.
"""
import json
import sys
from pathlib import Path

import pytest

from alpa_lite.compiler.stage_dp import bubble_fraction
from alpa_lite.runtime.launch import torchrun

WORKER = str(Path(__file__).parent / "workers" / "pipeline_idle.py")
TOLERANCE = 0.07  # |measured - predicted| idle share: transfers and Python between the padded passes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_idle") / "results.json"
    rc = torchrun([WORKER, "--out", str(out)], nproc=4, timeout_s=240,
                  env={"PYTHONPATH": str(Path(__file__).parents[1])}, stdout=sys.stderr)
    assert rc == 0, f"torchrun exited with {rc}"
    return json.loads(out.read_text())


def predicted(run: dict) -> float:
    """The schedule model's bubble for the padded equal stages of ``run``."""
    return bubble_fraction([run["stage_seconds"]] * run["num_stages"], run["num_microbatches"],
                           run["record"]["name"], run["chunks"])


def test_every_rank_is_busy_for_its_padded_passes(runs):
    for name, run in runs.items():
        bubble = run["record"]["bubble"]
        assert len(bubble["by_rank"]) == len(bubble["busy_s"]) == 4, name
        assert len(bubble["samples"]) == run["record"]["timed_steps"] == 5, name
        # B microbatches x (forward + backward) of every chunk of the rank; a sleep is never shorter, a
        # pass starved of CPU may outlast its pad
        busy = run["num_microbatches"] * run["chunks"] * run["stage_seconds"]
        assert all(busy <= b <= 1.25 * busy for b in bubble["busy_s"]), (name, busy, bubble["busy_s"])
        assert 0 <= bubble["measured"] < 1 and bubble["schedule_s"] > busy, name


def test_zero_bubble_and_interleaved_idle_less_than_1f1b(runs):
    assert [predicted(runs[n]) for n in ("1f1b", "zb-h1", "interleaved")] == pytest.approx([3 / 7, 1 / 5, 3 / 11])
    one_f_one_b = runs["1f1b"]["record"]["bubble"]["measured"]
    for name in ("zb-h1", "interleaved"):
        assert runs[name]["record"]["bubble"]["measured"] < one_f_one_b, (name, runs[name]["record"]["bubble"])


def test_measured_idle_is_the_predicted_bubble(runs):
    for name, run in runs.items():
        bubble = run["record"]["bubble"]
        assert bubble["measured"] == pytest.approx(predicted(run), abs=TOLERANCE), (name, bubble)
        assert all(x == pytest.approx(predicted(run), abs=TOLERANCE) for x in bubble["by_rank"]), (name, bubble)
