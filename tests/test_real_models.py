"""Models from the ecosystem train equal to one process (``alpa_lite.tools.verify``, 4 gloo ranks, 2x2).

Small configs with random weights (``alpa_lite.zoo.models``): HF LLaMA (grouped-query attention,
RoPE), HF Mixtral (top-2 MoE), HF BERT (padding attention masks), HF T5 (encoder-decoder; also
called as HF models are, with a dict of keyword inputs) and a ResNet-18 with BatchNorm, each under
data parallel and the auto plan, LLaMA also under Megatron-style specs. 2 SGD steps; verify's
tolerance (fp32: 1e-4 of each tensor's gradient / update, see ``alpa_lite/tools/verify.py``).
All cases run in one torchrun launch.

The HF sweep (:data:`SWEEP`, tiny configs: hidden 32, 2 layers, seq 8) adds plan kinds (a 2-stage x
2-device pipeline of 2 microbatches, with Megatron specs inside the stages; ZeRO-3; 2D with
ZeRO-2; accumulate=2; a vocab-parallel head tied to the embedding) and architectures: GPT-2
(``Conv1D`` weights [in, out], Megatron-split), Qwen2 (tied embeddings; right padding with
``-100`` labels on padded and some other tokens, so microbatches count different tokens; HF
Trainer's ``num_items_in_batch`` accumulated), Qwen3 (per-head q/k RMSNorm, heads split in the
pipeline's stages), Gemma 2 (soft-capping, sliding window, eager attention), Phi (parallel
attention + MLP, partial rotary), OPT and ViT (images). All equal; the sweep also ran each HF model
under data parallel, auto, ZeRO-1/2, ``remat="all"``, ``compile="aot_eager"``, bf16 and clipping,
all equal. Found: HF Mixtral's ``loss += coef * aux_loss`` (with ``output_router_logits``) was
read as nonlinear at its ``add_``; in-place arithmetic on a ``reduction="sum"`` loss halved it
under microbatches (``test_patterns``' ``inplace_sum_loss``). Mixtral's load-balancing loss is a
product of batch means and differs under microbatches, as the pipeline's warning says.

The ResNets run at batch 16: at batch 8 the second batch puts one pre-activation of
``stages.3.0`` (1x1 maps, 8 values per channel) 1e-6 from zero, so rounding within bounds (of
step 1, or of step 2's batch-norm sums, added in another order) flips that ReLU in step 2 and
moves its layer's gradient by 5%. Data parallel flips it wherever the batch statistics are
summed in one all-reduce over 4 devices (1x4, 4x1, and 2x2 since the sum over both axes is one
all-reduce): the parallel step 2 equals one process run from the parallel weights with that one
ReLU flipped, to 8e-6 relative (without the flip: 7.6e-2).
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
CASES = {
    "llama-dp": {"model": "llama", "seq": 8, "options": DP},
    "llama-auto": {"model": "llama", "seq": 8, "options": {}},
    "llama-megatron": {"model": "llama", "seq": 8, "options": llama_megatron()},
    "mixtral-dp": {"model": "mixtral", "seq": 8, "options": DP},
    "mixtral-auto": {"model": "mixtral", "seq": 8, "options": {}},
    "bert-dp": {"model": "bert", "seq": 8, "options": DP},
    "bert-auto": {"model": "bert", "seq": 8, "options": {}},
    "t5-dp": {"model": "t5", "seq": 8, "options": DP},
    # HF T5 itself, model(**batch) with input_ids=, attention_mask=, labels=; its own out.loss
    "t5-keywords": {"model": "t5", "seq": 8, "options": DP, "keywords": True},
    "t5-keywords-auto": {"model": "t5", "seq": 8, "options": {}, "keywords": True},
    "resnet-dp": {"model": "resnet", "batch": 16, "options": DP},
    "resnet-auto": {"model": "resnet", "batch": 16, "options": {}},
}


def gpt2_megatron(layers: int = 2) -> dict:
    """Megatron specs for HF GPT-2, whose ``Conv1D`` weights are [in, out] (run as ``addmm``): the
    fused ``c_attn`` and ``c_fc`` split by output (RS1), the projections by input (S1R)."""
    specs = {}
    for i in range(layers):
        b = f"model.transformer.h.{i}"
        specs |= {f"{b}.attn.c_attn.weight": "RS1", f"{b}.mlp.c_fc.weight": "RS1",
                  f"{b}.attn.c_proj.weight": "S1R", f"{b}.mlp.c_proj.weight": "S1R"}
    return {"batch_axis": 0, "param_specs": specs}


# the HF sweep: more plan kinds and architectures, tiny (hidden 32, 2 layers, seq 8)
TINY = {"hidden_size": 32, "intermediate_size": 64}
PIPE = {"pipeline": 2, "num_microbatches": 2, "num_layers": 2}
PIPE_MEGATRON = PIPE | {"param_specs": llama_megatron()["param_specs"]}
SWEEP = {
    "llama-pipe_megatron": ("llama", TINY | {"head_dim": 8}, PIPE_MEGATRON),
    "llama-zero3": ("llama", TINY | {"head_dim": 8}, DP | {"zero_stage": 3}),
    "llama-2d_zero2": ("llama", TINY | {"head_dim": 8}, llama_megatron() | {"zero_stage": 2}),
    "bert-pipe": ("bert", TINY, PIPE),
    "t5-pipe": ("t5", {"d_model": 32, "d_kv": 8, "d_ff": 64}, PIPE),
    "gpt2-hf-megatron": ("gpt2-hf", {"n_embd": 32}, gpt2_megatron()),
    "qwen2-pipe": ("qwen2", TINY | {"head_dim": 8}, PIPE),
    "qwen2-vocab": ("qwen2", TINY | {"head_dim": 8}, {"batch_axis": 0, "param_specs": llama_megatron()["param_specs"]
                                                     | {"model.lm_head.weight": "S1R"}}),
    "qwen2-num_items-accumulate": ("qwen2", TINY | {"head_dim": 8, "num_items": True}, DP | {"accumulate": 2}),
    "qwen3-pipe_megatron": ("qwen3", TINY | {"head_dim": 8}, PIPE_MEGATRON),
    "gemma2-dp": ("gemma2", TINY | {"head_dim": 8}, DP),
    "phi-pipe": ("phi", TINY, PIPE),
    "opt-auto": ("opt", {"hidden_size": 32, "ffn_dim": 64, "word_embed_proj_dim": 32}, {}),
    "vit-pipe": ("vit", TINY, PIPE),
}
CASES |= {name: {"model": m, "seq": 8, "overrides": ov, "options": o} for name, (m, ov, o) in SWEEP.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "results.json"
    code = torchrun([WORKER, "--cases", json.dumps(CASES), "--out", str(out)], nproc=4, timeout_s=1500)
    assert code == 0, f"torchrun exited with {code}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_trains_equal_to_one_process(results, name):
    r = results[name]
    assert "error" not in r, r["error"]
    bad = [(x["kind"], x["name"], x["step"], x["max_diff"], x["bound"], x["note"]) for x in r["rows"] if not x["ok"]]
    assert r["verdict"] == "equal", bad[:5]
    kinds = {"loss", "grad", "param"} | ({"buffer"} if CASES[name]["model"] == "resnet" else set())
    assert {x["kind"] for x in r["rows"]} >= kinds


def test_the_auto_and_megatron_plans_shard_parameters(results):
    """The non-DP cases are not data parallel in disguise (the auto plan of LLaMA at this size is)."""
    for name in ("llama-megatron", "mixtral-auto", "bert-auto", "resnet-auto", "gpt2-hf-megatron", "qwen2-vocab"):
        assert " 0 of " not in results[name]["plan"], results[name]["plan"]
