"""Gradient buckets all-reduced during backward (``runtime/grad_sync.py``) give the same training
as all-reducing them after backward, on 4 gloo ranks, for every kind of plan; and a peer that
dies while buckets are in flight ends the job with an error, not a hang."""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from alpa_lite.runtime.launch import torchrun

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
    "2d": {"param_specs": megatron(2, "S01"), "bucket_bytes": SMALL},
    "zero3": {"force_data_parallel": True, "bucket_bytes": SMALL,
              "param_specs": {k: "S01R" for k, v in megatron(2).items() if v == "S1R"}},
    "pipeline": {"num_stages": 2, "num_microbatches": 2, "num_layers": 2, "force_data_parallel": True,
                 "bucket_bytes": SMALL},
}


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


def test_peer_dead_mid_backward_fails_fast_and_is_named(tmp_path):
    log = tmp_path / "log.txt"
    start = time.monotonic()
    with open(log, "w") as f:
        code = torchrun([str(WORKERS / "bad_input.py"), "--case", "dead-in-backward", "--out", str(tmp_path / "x")],
                        nproc=4, timeout_s=240, stdout=f, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - start
    text = log.read_text()
    assert code != 0
    assert elapsed < 120, elapsed  # the collective timeout is 15 s; no hang on an outstanding handle
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*3", text), text[-3000:]
