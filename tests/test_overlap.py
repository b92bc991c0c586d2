"""Gradient buckets all-reduced during backward (``runtime/grad_sync.py``) give the same training
as all-reducing them after backward, on 4 gloo ranks, for every kind of plan; and a peer that
stops while buckets are in flight ends the job with an error naming the rank, not a hang."""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from alpa_lite import LogicalMesh, plan
from alpa_lite.core.plan import gradient_buckets
from alpa_lite.runtime.launch import torchrun
from alpa_lite.zoo.models import build_model

WORKERS = Path(__file__).parent / "workers"
SMALL = 8192  # bytes per bucket: several buckets per step, so ordering and partial readiness are exercised


def megatron(layers, axis="S1"):
    specs = {}
    for i in range(layers):
        b = f"blocks.{i}"
        specs |= {f"{b}.attn.qkv.weight": f"{axis}R", f"{b}.attn.proj.weight": f"R{axis}",
                  f"{b}.ffn.fc.weight": f"{axis}R", f"{b}.ffn.proj.weight": f"R{axis}"}
    return specs


PLANS = {
    "dp": {"force_data_parallel": True, "bucket_bytes": SMALL},
    "megatron": {"batch_axis": 0, "param_specs": megatron(2), "bucket_bytes": SMALL},
    "2d": {"batch_axis": 0, "param_specs": megatron(2, "S01"), "bucket_bytes": SMALL},  # batch split: buckets
    "zero3": {"force_data_parallel": True, "bucket_bytes": SMALL,
              "param_specs": {k: "S01R" for k, v in megatron(2).items() if v == "S1R"}},
    "pipeline": {"num_stages": 2, "num_microbatches": 2, "num_layers": 2, "force_data_parallel": True,
                 "bucket_bytes": SMALL},
}


def test_buckets_become_ready_in_launch_order_tied_weight_last():
    # Backward completes a gradient at the parameter's first use; the buckets launch in reverse
    # order, so each bucket's first uses must all come before the next one's. GPT's tied
    # wte / lm_head placeholder is the graph's last, but its gradient is complete only at the
    # embedding: in the last bucket launched. Ordered by placeholders it was in the first one
    # launched, and every bucket waited for the end of backward (measured on the benchmark GPT
    # of docs/runtime_cpu.md: all 4 buckets started in the last 3 ms of a 387 ms backward).
    model, example = build_model("gpt-tiny", 8, 16, device="meta", hidden=32, num_layers=2, num_heads=2)
    p = plan(model, example, LogicalMesh((1, 4)), force_data_parallel=True, bucket_bytes=SMALL)
    cg = p.captured
    buckets = [members for _, _, members in gradient_buckets(cg, p.nodes, p.grad_sync, (1, 4), SMALL)]
    position = {n.name: i for i, n in enumerate(cg.graph.nodes)}
    firsts = [[min(position[u.name] for u in cg.node(ph).users) for ph in members] for members in buckets]
    assert len(buckets) >= 3 and all(max(a) <= min(b) for a, b in zip(firsts, firsts[1:])), firsts
    tied = next(ph for ph, fqn in cg.param_fqns.items() if fqn == "lm_head.weight")
    assert list(cg.param_fqns)[-1] == tied and tied in buckets[0]
    assert sum(map(len, buckets)) == len(p.grad_sync)


def test_a_bucket_holds_one_dtype():
    """The runtime sums a bucket as one flat tensor of one dtype: a complex parameter (an FNO's
    Fourier weights) beside fp32 ones lost the imaginary part of its gradient there, silently, and
    a float64 head's gradients were rounded to fp32 (sweep 12). Each bucket now holds one dtype."""
    import sys
    sys.path.insert(0, str(WORKERS))
    import patterns
    for name in ("spectral", "float64_head"):
        model, example = getattr(patterns, name)(8)
        for zero in (1, 2):
            p = plan(model, example, LogicalMesh((2, 2)), force_data_parallel=True, zero_stage=zero)
            buckets = gradient_buckets(p.captured, p.nodes, p.grad_sync, (2, 2), p.bucket_bytes)
            dtypes = [{p.captured.node(ph).meta["val"].dtype for ph in members} for _, _, members in buckets]
            assert all(len(d) == 1 for d in dtypes) and len(dtypes) == 2, (name, zero, dtypes)
            assert sum(len(m) for _, _, m in buckets) == len(p.grad_sync)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap") / "results.json"
    assert torchrun([str(WORKERS / "overlap.py"), "--plans", json.dumps(PLANS), "--out", str(out)],
                    nproc=4, timeout_s=600) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(PLANS))
def test_overlapped_step_equals_plain_step(results, name):
    r = results[name]
    assert r["losses"] == r["plain_losses"]
    assert r["param_diff"] == 0.0  # the same sums of the same bucket contents
    # on every rank, each of its (several) buckets started from a hook while backward ran
    assert all(n == t >= 2 for n, t in r["buckets"]), r["buckets"]
    if name != "pipeline":  # one SPMD step issues exactly the plan's collectives
        assert r["runtime_counts"] == r["plan_counts"]


# the runtime's message on a survivor: it names itself, the collective and its mesh axes
# (DP on 2x2: the deferred loss all-reduce too, when rank 1 stopped before it completed)
NAMED = {"stopped-in-backward": r"the all-reduce (?:of gradient bucket \d+|of the loss|in backward) over mesh axes "
                                r"\(\d(?:, 1)?,?\)",
         "stopped-in-backward-zero3": r"the (?:all-gather of a ZeRO-3 group \(backward\)|reduce-scatter of a ZeRO-3 "
                                      r"group's gradients) over mesh axes \(1,\)",
         # 2 stages x 2 DP devices: stage 0 waits on the gradients the stopped last stage (rank 3,
         # with its loss's deferred all-reduce in flight) and its peer (stuck with it) do not send;
         # that peer's own collective with rank 3 may time out first
         "stopped-in-backward-pipeline": r"(?:the receive of microbatch \d's gradients from rank [23]|the all-gather "
                                         r"in backward over mesh axes \(1,\))",
         # compiled, DP: a survivor's graph names itself with its bucket all-reduces in flight; the pipeline:
         # stage 0's receive times out first (and the launcher ends the stopped rank's stage peer, whose forward
         # graph all-reduces with it, before its own timeout names it)
         "stopped-in-graph": r"a collective of the compiled step \(forward, backward or a gradient bucket\)",
         "stopped-in-graph-pipeline": r"(?:a collective of the compiled stage's forward|the receive of microbatch "
                                      r"\d's gradients from rank [23])"}


@pytest.mark.parametrize("case", list(NAMED))
def test_peer_stopped_mid_backward_fails_on_the_timeout_and_is_named(tmp_path, case):
    # rank 1 stops itself (SIGSTOP) in backward without exiting, so the launcher tears nothing
    # down: the others must end on their own collective timeout (15 s after the first step), each naming itself and
    # what it waited on, with no hang on an outstanding async handle (DP: bucket all-reduces in
    # flight, and the loss's deferred all-reduce; ZeRO-3: group reduce-scatters and a prefetched all-gather)
    log, stopped_at = tmp_path / "log.txt", tmp_path / "stopped"
    with open(log, "w") as f:
        code = torchrun([str(WORKERS / "bad_input.py"), "--case", case, "--out", str(stopped_at)],
                        nproc=4, timeout_s=240, stdout=f, stderr=subprocess.STDOUT)
    ended = time.time()
    text = log.read_text()
    assert code != 0
    # the 15 s timeout, 2.5 s reading the heartbeats, the launcher's teardown: ~20 s on a quiet
    # machine; a hang on an async handle runs into the 240 s above
    assert ended - float(stopped_at.read_text()) < 90
    named = re.findall(r"rank (\d): " + NAMED[case] + r" failed \(a peer died, stopped or timed out\)", text)
    stopped = "3" if case.endswith("pipeline") else "1"
    errors = "\n".join(line for line in text.splitlines() if "Error: " in line)[-3000:]  # the ranks' errors
    assert named and stopped not in named, errors  # a survivor names itself; the stopped rank says nothing
    # and, by the ranks' heartbeats, the rank that stopped (a pipeline's survivor waits on its own
    # peer, not on the rank that stopped; a survivor that exited first may be silent too)
    silent = re.findall(r"failed \(a peer died, stopped or timed out\); silent \(died or stopped\): ranks? "
                        r"(\d(?:, \d)*):", text)
    assert silent and all(stopped in s.split(", ") for s in silent), errors


def test_predicted_overlap_hides_all_buckets_but_the_first_up_to_backward():
    from dataclasses import replace

    from alpa_lite import LogicalMesh, plan
    from alpa_lite.core.plan import Collective
    from alpa_lite.zoo.models import build_model

    model, example = build_model("mlp", 8, hidden=32, num_layers=2)
    base = plan(model, example, LogicalMesh((2, 2), cluster="cpu-gloo"), force_data_parallel=True)
    bucket = lambda k, s: Collective("all-reduce", (0, 1), 1e6, "backward", f"gradient bucket {k}", "", s)  # noqa: E731
    other = Collective("all-gather", (1,), 1e6, "forward", "mm", "x", 0.5)
    p = replace(base, collectives=[other, bucket(0, 1.0), bucket(1, 2.0), bucket(2, 3.0)], compute_seconds=9.0,
                comm_seconds=6.5, update_seconds=0.0)
    assert p.overlap_seconds == 5.0  # buckets 1 and 2; bucket 0 is ready only when backward ends
    assert p.step_seconds == 9.0 + 6.5 - 5.0
    short = replace(p, compute_seconds=3.0)  # backward (2/3 of compute) hides at most 2 s
    assert short.overlap_seconds == 2.0 and short.step_seconds == 3.0 + 6.5 - 2.0
    # the optimizer update runs after backward: 1.5 s of it leave 2/3 of 1.5 s to hide in
    assert replace(short, update_seconds=1.5).overlap_seconds == 1.0
    assert replace(p, collectives=[other, bucket(0, 1.0)]).overlap_seconds == 0.0
    assert replace(p, collectives=[other]).overlap_seconds == 0.0
    # the first bucket of each kind and axes holds its parameters used first: not hidden either
    rs = replace(bucket(2, 3.0), kind="reduce-scatter")
    assert replace(p, collectives=[other, bucket(0, 1.0), bucket(1, 2.0), rs]).overlap_seconds == 2.0
