"""The model zoo (alpa_lite.zoo.models) and the tinyshakespeare data (alpa_lite.zoo.data)."""
from __future__ import annotations

import math
import os
import sys
import time
import types

import pytest
import torch

from alpa_lite.zoo import data
from alpa_lite.zoo.models import (
    HF_MODEL_NAMES,
    MODEL_NAMES,
    GPT,
    build_model,
    count_parameters,
    top2_gating,
)

# Models whose full depth takes long to export: shrink them (same widths) for the export test.
_SHRINK = {"num_layers": 2}
_SHRINK_WRN = {"stage_sizes": (1, 1, 1, 1)}


def _small_overrides(name: str) -> dict:
    if name.startswith(("gpt2-", "gpt3-", "moe-")) and name != "gpt2-hf":
        return dict(_SHRINK)
    if name.startswith("wide-resnet-"):
        return dict(_SHRINK_WRN)
    return {}


# input_ids (or images) and labels, plus an attention mask for these
_WITH_MASK = ("bert", "t5", "qwen2", "qwen3", "gemma", "gemma2", "opt", "phi")


def _export(model, inputs):
    return torch.export.export(model, inputs, strict=False)


def test_model_names():
    expected = {
        "mlp", "gpt-tiny", "gpt2-small", "gpt2-medium",
        "gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.6b", "gpt3-6.7b", "gpt3-15b", "gpt3-39b",
        "moe", "wide-resnet", "bert", "gpt2-hf", "llama", "mixtral", "t5", "resnet",
    }
    assert expected <= set(MODEL_NAMES)
    assert len(MODEL_NAMES) == len(set(MODEL_NAMES))


# One model per family is exported in the default run (each export takes ~0.3-1 s); the sweep
# over every size runs with ALPA_LITE_SLOW_TESTS=1. The sizes differ only in widths/depths.
_EXPORT_ALWAYS = ["mlp", "gpt-tiny", "gpt3-125m", "moe", "moe-380m", "wide-resnet", "wide-resnet-250m",
                  "bert", "gpt2-hf", "llama", "mixtral", "t5", "resnet"]
_SLOW = os.environ.get("ALPA_LITE_SLOW_TESTS", "") not in ("", "0")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_builds_on_meta(name):
    if name in HF_MODEL_NAMES:
        pytest.importorskip("transformers")
    model, inputs = build_model(name, batch=2)
    assert isinstance(inputs, tuple) and len(inputs) == (3 if name in _WITH_MASK else 2)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(t.device.type == "meta" for t in inputs)
    assert model.training


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_exports_on_meta(name):
    if name not in _EXPORT_ALWAYS and not _SLOW:
        pytest.skip("export of every size: set ALPA_LITE_SLOW_TESTS=1")
    if name in HF_MODEL_NAMES:
        pytest.importorskip("transformers")
    model, inputs = build_model(name, batch=2, seq=32 if name != "mlp" else None, **_small_overrides(name))
    assert isinstance(inputs, tuple) and len(inputs) == (3 if name in _WITH_MASK else 2)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(t.device.type == "meta" for t in inputs)
    assert all(t.shape[0] == 2 for t in inputs)
    ep = _export(model, inputs)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("linear" in o or "conv2d" in o or "addmm" in o for o in ops), ops
    (out,) = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][-1:]
    assert tuple(out.meta["val"].shape) == ()  # the exported graph returns a scalar loss


@pytest.mark.parametrize("name,nominal", [("gpt3-1.3b", 1.3e9), ("gpt3-2.6b", 2.6e9), ("gpt3-39b", 39e9),
                                          ("gpt2-small", 124e6), ("moe-1.3b", 1.3e9),
                                          ("wide-resnet-250m", 250e6)])
def test_parameter_counts(name, nominal):
    t0 = time.perf_counter()
    model, _ = build_model(name, batch=1)
    assert time.perf_counter() - t0 < 5.0  # meta construction allocates nothing
    n = count_parameters(model)
    assert abs(n - nominal) / nominal < 0.05, (name, n)


def test_gpt3_39b_shape_and_overrides():
    model, (idx, tgt) = build_model("gpt3-39b", batch=4)
    c = model.config
    assert (c.hidden, c.num_layers, c.num_heads, c.vocab_size, c.seq_len) == (8192, 48, 64, 51200, 1024)
    assert idx.shape == tgt.shape == (4, 1024) and idx.dtype == torch.long
    assert model.lm_head.weight is model.wte.weight
    small, (idx, _) = build_model("gpt3-39b", batch=4, seq=128, num_layers=2)
    assert len(small.blocks) == 2 and small.config.hidden == 8192 and idx.shape == (4, 128)
    with pytest.raises(TypeError, match="unknown override"):
        build_model("gpt3-39b", batch=1, not_a_field=3)


def test_gpt_tiny_cpu_loss_at_init():
    model, (idx, tgt) = build_model("gpt-tiny", batch=4, device="cpu")
    assert isinstance(model, GPT) and model.config.vocab_size == 65 and idx.shape == (4, 64)
    loss = model(idx, tgt)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(65)) < 0.15  # near-uniform predictions at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    ep = _export(model, (idx, tgt))
    torch.testing.assert_close(ep.module()(idx, tgt), loss.detach())


def test_megatron_qkv_layout_is_a_permutation_of_gpt2s():
    """``qkv_layout="megatron"`` reads the fused qkv output per head, ``[q_h; k_h; v_h]``: with the
    gpt2 layout's qkv rows (and bias) permuted into that order, the loss and every other
    gradient are the same."""
    (gpt2, inputs), (megatron, _) = (build_model("gpt-tiny", batch=2, seq=16, device="cpu", qkv_layout=q)
                                     for q in ("gpt2", "megatron"))
    h, nh = gpt2.config.hidden, gpt2.config.num_heads
    hd = h // nh
    # megatron row (head i, part j in q/k/v, feature d) <- gpt2 row j * h + i * hd + d
    order = torch.arange(3 * h).view(3, nh, hd).transpose(0, 1).reshape(-1)
    state = {k: (v[order] if ".attn.qkv." in k else v) for k, v in gpt2.state_dict().items()}
    megatron.load_state_dict(state)
    loss_a, loss_b = gpt2(*inputs), megatron(*inputs)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
    loss_a.backward()
    loss_b.backward()
    for (k, a), b in zip(gpt2.named_parameters(), megatron.parameters()):
        torch.testing.assert_close(b.grad, a.grad[order] if ".attn.qkv." in k else a.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="qkv_layout must be one of"):
        build_model("gpt-tiny", batch=1, qkv_layout="per-head")


@pytest.mark.parametrize("name", ["mlp", "moe", "wide-resnet", "bert", "gpt2-hf", "llama"])
def test_small_models_run_and_export_on_cpu(name):
    if name in HF_MODEL_NAMES:
        pytest.importorskip("transformers")
    model, inputs = build_model(name, batch=2, device="cpu")
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    ep = _export(model, inputs)
    model2, _ = build_model(name, batch=2, device="cpu")  # fresh BatchNorm statistics
    torch.testing.assert_close(ep.module()(*inputs), model2(*inputs))


def test_build_is_deterministic_and_keeps_global_rng():
    state = torch.get_rng_state()
    m1, x1 = build_model("moe", batch=2, device="cpu")
    m2, x2 = build_model("moe", batch=2, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(x1, x2):
        assert torch.equal(a, b)
    m3, _ = build_model("moe", batch=2, device="cpu", seed=1)
    assert not torch.equal(m3.wte.weight, m1.wte.weight)


def test_mlp_shape():
    model, (x, y) = build_model("mlp", batch=8)
    assert len(model.layers) == 6 and model.layers[0].weight.shape == (256, 256)
    assert x.shape == y.shape == (8, 256)
    model, (x, _) = build_model("mlp", batch=8, hidden=64, num_layers=3, bias=False)
    assert len(model.layers) == 3 and model.layers[0].bias is None and x.shape == (8, 64)


def test_bad_name_lists_valid_names():
    with pytest.raises(ValueError, match="gpt3-39b"):
        build_model("gpt5", batch=1)
    with pytest.raises(ValueError, match="mlp"):
        build_model("no_such_module_xyz:make", batch=1)


def test_custom_callable(monkeypatch):
    mod = types.ModuleType("alpa_lite_test_zoo")

    def make(batch, seq):
        model = torch.nn.Linear(seq, 1)
        return model, (torch.zeros(batch, seq),)

    mod.make = make
    monkeypatch.setitem(sys.modules, "alpa_lite_test_zoo", mod)
    model, (x,) = build_model("alpa_lite_test_zoo:make", batch=3, seq=5)
    assert x.shape == (3, 5) and x.device.type == "meta" and model.weight.device.type == "meta"


def test_top2_gating():
    gates = torch.softmax(torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    combine, dispatch = top2_gating(gates, capacity=16)  # room for everyone
    assert combine.shape == dispatch.shape == (2, 16, 4, 16)
    assert torch.equal(dispatch.sum(dim=(2, 3)), torch.full((2, 16), 2.0))  # two experts per token
    torch.testing.assert_close(combine.sum(dim=(2, 3)), torch.ones(2, 16))
    assert (dispatch.sum(dim=1) <= 1).all()  # one token per expert slot
    _, dispatch = top2_gating(gates, capacity=2)  # overflow is dropped
    assert (dispatch.sum(dim=(1, 3)) <= 2).all() and (dispatch.sum(dim=1) <= 1).all()


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def test_tokenizer_roundtrip():
    text = data.load_text()
    assert len(text) == 1_115_394 and text.startswith("First Citizen:")
    tok = data.CharTokenizer(text)
    assert tok.vocab_size == 65 == len(tok)
    sample = text[:5000]
    ids = tok.encode(sample)
    assert max(ids) < 65 and tok.decode(ids) == sample
    assert tok.decode(tok.encode_tensor(sample)) == sample
    with pytest.raises(ValueError):
        tok.encode("\u00e9")


def test_batches_deterministic_and_shifted():
    tok, tokens = data.load_tokens()
    assert tokens.dtype == torch.long and tokens.numel() == 1_115_394
    a = list(data.batches(tokens, batch=4, seq=16, seed=3, num_batches=3))
    b = list(data.batches(tokens, batch=4, seq=16, seed=3, num_batches=3))
    c = list(data.batches(tokens, batch=4, seq=16, seed=4, num_batches=3))
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == ya.shape == (4, 16) and xa.dtype == ya.dtype == torch.long
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the inputs shifted by one
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    text = tok.decode(a[0][0][0]) + tok.decode(a[0][1][0][-1:])
    assert text in data.load_text()


def test_real_model_builders_have_the_features_they_are_named_for():
    pytest.importorskip("transformers")
    llama, _ = build_model("llama", batch=2, seq=8)
    c = llama.model.config
    assert c.num_key_value_heads < c.num_attention_heads  # grouped-query attention
    mixtral, _ = build_model("mixtral", batch=2, seq=8)
    assert mixtral.model.config.num_local_experts == 4 and mixtral.model.config.num_experts_per_tok == 2
    _, (ids, mask, labels) = build_model("bert", batch=4, seq=8, device="cpu")
    assert mask.sum(1).tolist() == [8, 6, 4, 2] and labels.shape == ids.shape  # rows padded differently
    t5, (ids, mask, labels) = build_model("t5", batch=2, seq=8, device="cpu")
    assert t5.keys == ("input_ids", "attention_mask", "labels") and labels.shape == (2, 4)
    assert torch.isfinite(t5(ids, mask, labels))
    resnet, (images, _) = build_model("resnet", batch=2)
    assert resnet.config.stage_sizes == (2, 2, 2, 2) and not resnet.config.bottleneck  # ResNet-18
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.modules()) == 20 and images.shape == (2, 3, 32, 32)
