"""Models from the ecosystem train equal to one process (``alpa_lite.tools.verify``, 4 gloo ranks, 2x2).

Small configs with random weights (``alpa_lite.zoo.models``): HF LLaMA (grouped-query attention,
RoPE), HF Mixtral (top-2 MoE), HF BERT (padding attention masks), HF T5 (encoder-decoder; also
called as HF models are, with a dict of keyword inputs) and a ResNet-18 with BatchNorm, each under
data parallel and the auto plan, LLaMA also under Megatron-style specs. 2 SGD steps; verify's
tolerance (fp32: 1e-4 of each tensor's gradient / update, see ``alpa_lite/verify.py``).
All cases run in one torchrun launch. Cases blocked by a class of issue 9 that another branch
fixes are strict xfails naming that class, so they flip when it is merged.
"""
import json
from pathlib import Path

import pytest

from alpa_lite.runtime.launch import torchrun

pytest.importorskip("transformers")

WORKER = str(Path(__file__).parent / "workers" / "verify_cases.py")


def llama_megatron(layers: int = 2) -> dict:
    """Megatron-LM column-then-row specs for HF LLaMA (weights are [out, in]): q/k/v and gate/up
    split by output (S1R: whole heads per device, 2 of 4 query and 1 of 2 key/value heads), o and
    down by input (RS1), the batch on axis 0."""
    specs = {}
    for i in range(layers):
        b = f"model.model.layers.{i}"
        specs |= {f"{b}.self_attn.{m}.weight": "S1R" for m in ("q_proj", "k_proj", "v_proj")}
        specs |= {f"{b}.mlp.{m}.weight": "S1R" for m in ("gate_proj", "up_proj")}
        specs |= {f"{b}.self_attn.o_proj.weight": "RS1", f"{b}.mlp.down_proj.weight": "RS1"}
    return {"batch_axis": 0, "param_specs": specs}


DP = {"force_data_parallel": True}
KEYWORDS = "fix/placeholders: a dict of keyword inputs (issue 9, class 11), and T5's lifted constant (class 8)"
BUFFERS = "fix/placeholders: batch-norm statistics stored S0/S01 are updated on a resharded copy (issue 9, " \
          "class 6): running_mean/var end up to 0.19 off, gradients of step 2 0.014 off"
CASES = {
    "llama-dp": ({"model": "llama", "seq": 8, "options": DP}, None),
    "llama-auto": ({"model": "llama", "seq": 8, "options": {}}, None),
    "llama-megatron": ({"model": "llama", "seq": 8, "options": llama_megatron()}, None),
    "mixtral-dp": ({"model": "mixtral", "seq": 8, "options": DP}, None),
    "mixtral-auto": ({"model": "mixtral", "seq": 8, "options": {}}, None),
    "bert-dp": ({"model": "bert", "seq": 8, "options": DP}, None),
    "bert-auto": ({"model": "bert", "seq": 8, "options": {}}, None),
    "t5-dp": ({"model": "t5", "seq": 8, "options": DP}, None),
    "t5-keywords": ({"model": "t5", "seq": 8, "options": DP, "keywords": True}, KEYWORDS),
    "resnet-dp": ({"model": "resnet", "options": DP}, None),
    "resnet-auto": ({"model": "resnet", "options": {}}, BUFFERS),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "results.json"
    cases = {k: c for k, (c, _) in CASES.items()}
    code = torchrun([WORKER, "--cases", json.dumps(cases), "--out", str(out)], nproc=4, timeout_s=1500)
    assert code == 0, f"torchrun exited with {code}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=why, strict=True)) if why else n
                                  for n, (_, why) in CASES.items()])
def test_trains_equal_to_one_process(results, name):
    r = results[name]
    assert "error" not in r, r["error"]
    bad = [(x["kind"], x["name"], x["step"], x["max_diff"], x["bound"], x["note"]) for x in r["rows"] if not x["ok"]]
    assert r["verdict"] == "equal", bad[:5]
    assert {x["kind"] for x in r["rows"]} >= {"loss", "grad", "param"}


def test_the_auto_and_megatron_plans_shard_parameters(results):
    """The non-DP cases are not data parallel in disguise (the auto plan of LLaMA at this size is)."""
    for name in ("llama-megatron", "mixtral-auto", "bert-auto"):
        assert " 0 of " not in results[name]["plan"], results[name]["plan"]
