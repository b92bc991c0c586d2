"""The built-in model zoo: training models whose ``forward`` returns a scalar loss.

Every model here is built by :func:`build_model`, which returns ``(model, example_inputs)``.
The example inputs have *global* shapes (the whole batch), live on the requested device and
include the targets, so ``model(*example_inputs)`` is the training loss (a 0-d tensor).
This is the contract the rest of alpa-lite relies on: capture runs
``torch.export.export(model, example_inputs, strict=False)`` and the runtime differentiates
the loss.

Models are constructed under ``with torch.device(device)``: on the default ``"meta"``
device no memory is allocated, so even ``gpt3-39b`` builds in well under a second. On a
real device the weights are initialized deterministically (seed ``0`` unless the
``seed`` override says otherwise; see :func:`init_weights`). No model uses dropout unless
the built-in GPT's ``dropout`` override asks for it, so a training step is a deterministic
function of the weights and the batch.

Models and the source of each shape table:

- ``mlp``: Alpa's MLP test model (a stack of ``Linear(hidden, hidden)`` with ReLU between).
  Inputs ``x [batch, hidden]`` (float32), ``y [batch, hidden]`` (float32). Loss: MSE (mean).
- ``gpt2-small``, ``gpt2-medium``: the built-in :class:`GPT` with the GPT-2 shapes
  (Radford et al. 2019, Table 2: 768/12/12 and 1024/24/16, context 1024, vocabulary 50257,
  padded here to 50304 = 64 * 786).
- ``gpt3-125m`` ... ``gpt3-39b``: the built-in :class:`GPT` with Alpa's GPT-3 suite
  (Zheng et al., OSDI'22, Table 4 / ``benchmark/alpa/suite_paper_manual_gpt.py``:
  seq 1024, vocab 51200, (hidden, layers, heads) per size).
- ``gpt-tiny``: the built-in GPT for CPU tests (hidden 64, 2 layers, 4 heads, vocabulary 65
  = the characters of tinyshakespeare, seq 64).
  GPT inputs: ``idx [batch, seq]`` and ``targets [batch, seq]`` (int64). Loss: mean
  token cross-entropy.
- ``moe``, ``moe-380m`` ... ``moe-27b``: :class:`MoETransformer`, a GShard-style
  mixture-of-experts GPT (Lepikhin et al. 2021) with the shapes of Alpa's MoE suite
  (OSDI'22, Table 4 / ``benchmark/alpa/suite_paper_manual_moe.py``: seq 1024, vocab 32000,
  (hidden, layers, heads, experts), expert group size 2048, FFN width 8 * hidden).
  Inputs and loss as for GPT.
- ``wide-resnet``, ``wide-resnet-250m`` ... ``wide-resnet-13b``: :class:`WideResNet`
  (Zagoruyko & Komodakis 2016, in the ResNet-V1 form of Alpa's ``alpa/model/wide_resnet.py``;
  big shapes from Alpa's WResNet suite, OSDI'22 Table 4 /
  ``benchmark/alpa/suite_paper_wresnet.py``: image 224, depth 50, base channels, width
  factor, 1024 classes). Inputs ``images [batch, 3, H, W]`` (float32) and
  ``labels [batch]`` (int64). Loss: cross-entropy.
- ``resnet``: ResNet-18 (He et al. 2016, Table 1: basic blocks, 2-2-2-2, 7x7/2 stem with
  max-pool) as a :class:`WideResNet` of width factor 1 with narrow channels (8 ... 64) on
  32x32 images, 10 classes; BatchNorm in training mode. (torchvision's ``resnet18`` has the
  same structure; torchvision is not a dependency.) Inputs and loss as for ``wide-resnet``.
- ``bert``, ``gpt2-hf``, ``llama``, ``mixtral``, ``t5``: small HuggingFace ``transformers``
  models built from a config with random weights (never downloaded), wrapped by
  :class:`LossWrapper` so ``forward`` passes its tensors as HF keyword inputs and returns
  ``.loss``. ``gpt2-hf``, ``llama`` (grouped-query attention: 4 query heads, 2 key/value heads;
  RoPE) and ``mixtral`` (4 experts, top-2 routing, no auxiliary loss): ``input_ids [batch,
  seq]``, ``labels [batch, seq]`` (int64, HF shifts them). ``bert`` (masked LM): ``input_ids``,
  ``attention_mask [batch, seq]`` (padding: rows of different lengths), ``labels``. ``t5``
  (encoder-decoder): ``input_ids``, ``attention_mask``, ``labels [batch, seq // 2]``. Needs the
  ``hf`` extra.

A name of the form ``"package.module:callable"`` imports ``callable`` and calls it with
``batch=`` and ``seq=`` (and ``device=`` / the overrides, when its signature accepts them);
it must return ``(model, example_inputs)`` under the same contract.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODEL_NAMES",
    "build_model",
    "init_weights",
    "MLP",
    "GPTConfig",
    "GPT",
    "MoEConfig",
    "MoETransformer",
    "WideResNetConfig",
    "WideResNet",
    "LossWrapper",
    "count_parameters",
]

INIT_STD = 0.02  # GPT-2 / BERT initializer range


# --------------------------------------------------------------------------------------------
# MLP (Alpa's test model)
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``num_layers`` x ``Linear(hidden, hidden)`` with ReLU between them; loss MSE(out, y).

    The model of Alpa's auto-sharding unit tests (``tests/shard_parallel/test_mlp.py``).
    ``forward(x [B, hidden], y [B, hidden]) -> scalar``.
    """

    def __init__(self, hidden: int = 256, num_layers: int = 6, bias: bool = True):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"MLP needs num_layers >= 1, got {num_layers}")
        self.hidden = hidden
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i > 0:
                x = F.relu(x)
            x = layer(x)
        return F.mse_loss(x, y)


# --------------------------------------------------------------------------------------------
# GPT (GPT-2 / GPT-3 architecture)
# --------------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. ``seq_len`` is the size of the learned position table.

    ``dropout``: probability of GPT-2's attention dropout (on the attention weights) and
    residual dropout (on each sublayer's output before the residual add), in training; 0 (the
    default) adds no dropout op to the graph.

    ``qkv_layout``: how the fused ``qkv`` projection's ``3 * hidden`` output features are laid
    out. ``"gpt2"`` (GPT-2, nanoGPT): ``[q; k; v]``, each ``hidden`` wide, split apart on the
    feature dim. ``"megatron"`` (Megatron-LM, Shoeybi et al. 2019): per head, ``[q_h; k_h; v_h]``
    (the output viewed as ``[B, T, heads, 3 * head_dim]`` and split on the last dim), so that a
    column-parallel split of the weight's output features over ``n | heads`` devices gives each
    device whole heads and attention runs locally; with ``"gpt2"`` it must reshard q, k and v.
    """

    vocab_size: int = 50304
    seq_len: int = 1024
    hidden: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_mult: int = 4
    bias: bool = True
    layer_norm_eps: float = 1e-5
    qkv_layout: str = "gpt2"
    dropout: float = 0.0

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        _check_qkv_layout(self.qkv_layout)


QKV_LAYOUTS = ("gpt2", "megatron")


def _check_qkv_layout(layout: str) -> None:
    if layout not in QKV_LAYOUTS:
        raise ValueError(f"qkv_layout must be one of {QKV_LAYOUTS}, got {layout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused qkv projection, SDPA, output projection.

    ``qkv_layout``, ``dropout`` (on the attention weights, in training): see :class:`GPTConfig`."""

    def __init__(self, hidden: int, num_heads: int, bias: bool = True, qkv_layout: str = "gpt2",
                 dropout: float = 0.0):
        super().__init__()
        _check_qkv_layout(qkv_layout)
        self.num_heads, self.qkv_layout, self.dropout = num_heads, qkv_layout, dropout
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)
        self.proj.residual_out = True  # scaled init, see init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        nh = self.num_heads
        if self.qkv_layout == "megatron":  # [B, T, nh, 3 hd] -> 3 x [B, nh, T, hd]
            q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, T, nh, 3 * (H // nh)).split(H // nh, dim=3))
        else:  # [B, T, 3 H] -> 3 x [B, T, H] -> [B, nh, T, hd]
            q, k, v = (t.view(B, T, nh, H // nh).transpose(1, 2) for t in self.qkv(x).split(H, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, H)
        return self.proj(y)


class FeedForward(nn.Module):
    """Position-wise MLP ``Linear(h, m*h) -> GELU(tanh) -> Linear(m*h, h)``."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.proj = nn.Linear(ffn_hidden, hidden, bias=bias)
        self.proj.residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + ffn(ln2(x))``.

    ``ffn`` is a :class:`FeedForward` or, in the MoE model, a :class:`MoELayer`. ``dropout``:
    the attention's and the residual dropout's probability (:class:`GPTConfig`).
    """

    def __init__(self, hidden: int, num_heads: int, ffn: nn.Module, bias: bool = True, eps: float = 1e-5,
                 qkv_layout: str = "gpt2", dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=eps, bias=bias)
        self.attn = CausalSelfAttention(hidden, num_heads, bias=bias, qkv_layout=qkv_layout, dropout=dropout)
        self.ln2 = nn.LayerNorm(hidden, eps=eps, bias=bias)
        self.ffn = ffn
        self.dropout = dropout

    def _residual(self, y: torch.Tensor) -> torch.Tensor:
        return F.dropout(y, self.dropout, self.training) if self.dropout else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._residual(self.attn(self.ln1(x)))
        return x + self._residual(self.ffn(self.ln2(x)))


class GPT(nn.Module):
    """A GPT-2-style decoder-only language model returning the training loss.

    Token embedding ``wte [V, h]`` + learned positions ``wpe [seq_len, h]``, ``num_layers``
    pre-LN :class:`Block` s, a final LayerNorm and ``lm_head`` (``Linear(h, V, bias=False)``
    whose weight *is* ``wte.weight``: tied, one parameter).

    ``forward(idx [B, T] int64, targets [B, T] int64) -> scalar`` mean cross-entropy of
    predicting ``targets`` (already shifted by the caller: ``targets[:, t]`` is the token
    after ``idx[:, t]``), ``T <= seq_len``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.hidden)
        self.wpe = nn.Embedding(c.seq_len, c.hidden)
        self.blocks = nn.ModuleList(
            Block(c.hidden, c.num_heads, FeedForward(c.hidden, c.ffn_mult * c.hidden, c.bias), c.bias,
                  c.layer_norm_eps, c.qkv_layout, c.dropout)
            for _ in range(c.num_layers)
        )
        self.ln_f = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps, bias=c.bias)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (GPT-2)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` token ids -> ``[B, T, V]`` logits."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def init_weights(self, seed: int | None = 0) -> "GPT":
        """GPT-2 initialization (see :func:`init_weights`); returns ``self``."""
        init_weights(self, seed, num_layers=self.config.num_layers)
        return self


# --------------------------------------------------------------------------------------------
# GShard mixture of experts
# --------------------------------------------------------------------------------------------


@dataclass
class MoEConfig:
    """Shape of a :class:`MoETransformer` (Alpa's ``MoEModelConfig`` plus the FFN width).

    The defaults are the small ``moe`` model (one routing group per sequence); the
    ``moe-*`` suite uses Alpa's group size 2048. ``expert_group_size`` is GShard's group
    size S: tokens are routed within groups of S tokens, each expert takes at most
    ``capacity = capacity_factor * 2 * S / E`` tokens of a group (top-2 routing: 2 S
    assignments spread over E experts).
    """

    vocab_size: int = 512
    seq_len: int = 64
    hidden: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 4
    expert_group_size: int = 64
    ffn_mult: int = 8
    capacity_factor: float = 1.0
    bias: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})")
        if self.num_experts < 2:
            raise ValueError(f"top-2 routing needs num_experts >= 2, got {self.num_experts}")


def _one_hot(index: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``[...]`` int -> ``[..., n]`` 0/1 of ``dtype``, by comparison (no data-dependent checks)."""
    return (index.unsqueeze(-1) == torch.arange(n, device=index.device)).to(dtype)


def top2_gating(gates: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GShard top-2 routing with a fixed expert capacity, as dense tensors.

    ``gates [G, S, E]`` (softmax router probabilities) -> ``(combine, dispatch)``, both
    ``[G, S, E, C]``: ``dispatch[g, s, e, c] = 1`` when token s of group g sits in slot c of
    expert e; ``combine`` holds the renormalized gate weight there. Each token goes to its
    best and second-best expert; a token beyond an expert's capacity is dropped for that
    expert (first come, first served, best choices before second choices). No shape depends
    on the data. No auxiliary load-balancing loss is added (as in Alpa's benchmark model).
    """
    E = gates.shape[-1]
    dt = gates.dtype
    mask1 = _one_hot(gates.argmax(dim=-1), E, dt)  # [G, S, E]
    mask2 = _one_hot((gates * (1 - mask1)).argmax(dim=-1), E, dt)
    # slot of each token in its expert's buffer: running count over the group
    pos1 = torch.cumsum(mask1, dim=1) - 1  # [G, S, E]
    pos2 = torch.cumsum(mask2, dim=1) - 1 + mask1.sum(dim=1, keepdim=True)
    mask1 = mask1 * (pos1 < capacity).to(dt)
    mask2 = mask2 * (pos2 < capacity).to(dt)
    g1 = (gates * mask1).sum(dim=-1)  # [G, S]
    g2 = (gates * mask2).sum(dim=-1)
    denom = (g1 + g2).clamp_min(torch.finfo(dt).eps)
    g1, g2 = g1 / denom, g2 / denom
    slot1 = _one_hot((pos1 * mask1).sum(dim=-1).long(), capacity, dt)  # [G, S, C]
    slot2 = _one_hot((pos2 * mask2).sum(dim=-1).long(), capacity, dt)
    d1 = mask1.unsqueeze(-1) * slot1.unsqueeze(2)  # [G, S, E, C]
    d2 = mask2.unsqueeze(-1) * slot2.unsqueeze(2)
    combine = g1[..., None, None] * d1 + g2[..., None, None] * d2
    dispatch = d1 + d2
    return combine, dispatch


class MoELayer(nn.Module):
    """GShard MoE feed-forward layer with dense (einsum) dispatch.

    Router ``wg [h, E]``; experts as 3-D parameters ``w1 [E, h, f]``, ``b1 [E, f]``,
    ``w2 [E, f, h]``, ``b2 [E, h]``. ``x [B, T, h]`` is regrouped into ``[G, S, h]``
    (S = the largest divisor of B*T not above ``group_size``), routed by
    :func:`top2_gating`, dispatched with ``einsum('gsec,gsh->egch')``, run through all
    experts at once (``einsum`` over the expert dim) and combined back with
    ``einsum('gsec,egch->gsh')``. All shapes are static.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, group_size: int,
                 capacity_factor: float = 1.0, bias: bool = True):
        super().__init__()
        self.num_experts, self.group_size, self.capacity_factor = num_experts, group_size, capacity_factor
        E = num_experts
        self.wg = nn.Parameter(torch.empty(hidden, E))
        self.w1 = nn.Parameter(torch.empty(E, hidden, ffn_hidden))
        self.w2 = nn.Parameter(torch.empty(E, ffn_hidden, hidden))
        self.w2.residual_out = True
        self.b1 = nn.Parameter(torch.empty(E, ffn_hidden)) if bias else None
        self.b2 = nn.Parameter(torch.empty(E, hidden)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None, std: float = INIT_STD,
                         out_std: float | None = None) -> None:
        for p in (self.wg, self.w1):
            nn.init.normal_(p, 0.0, std, generator=generator)
        nn.init.normal_(self.w2, 0.0, std if out_std is None else out_std, generator=generator)
        for b in (self.b1, self.b2):
            if b is not None:
                nn.init.zeros_(b)

    def groups(self, num_tokens: int) -> tuple[int, int, int]:
        """``(G, S, C)``: number of groups, group size and expert capacity for ``num_tokens``."""
        S = min(self.group_size, num_tokens)
        while num_tokens % S:
            S -= 1
        C = max(1, int(self.capacity_factor * 2 * S / self.num_experts))
        return num_tokens // S, S, C

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        G, S, C = self.groups(B * T)
        xg = x.reshape(G, S, H)
        gates = torch.softmax(xg @ self.wg, dim=-1)  # [G, S, E]
        combine, dispatch = top2_gating(gates, C)
        expert_in = torch.einsum("gsec,gsh->egch", dispatch, xg)  # [E, G, C, h]
        h = torch.einsum("egch,ehf->egcf", expert_in, self.w1)
        if self.b1 is not None:
            h = h + self.b1[:, None, None, :]
        h = F.gelu(h, approximate="tanh")
        out = torch.einsum("egcf,efh->egch", h, self.w2)
        if self.b2 is not None:
            out = out + self.b2[:, None, None, :]
        y = torch.einsum("gsec,egch->gsh", combine, out)
        return y.reshape(B, T, H)


class MoETransformer(GPT):
    """GPT with GShard MoE layers: blocks alternate dense FFN (even) and MoE FFN (odd).

    As in Alpa's MoE benchmark model: every other transformer layer replaces its FFN with a
    :class:`MoELayer` of ``num_experts`` experts of width ``ffn_mult * hidden``, tied input
    and output embeddings. ``forward(idx [B, T], targets [B, T]) -> scalar`` cross-entropy.
    """

    def __init__(self, config: MoEConfig):
        nn.Module.__init__(self)
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.hidden)
        self.wpe = nn.Embedding(c.seq_len, c.hidden)
        blocks = []
        for i in range(c.num_layers):
            if i % 2 == 1:
                ffn = MoELayer(c.hidden, c.ffn_mult * c.hidden, c.num_experts, c.expert_group_size,
                               c.capacity_factor, c.bias)
            else:
                ffn = FeedForward(c.hidden, c.ffn_mult * c.hidden, c.bias)
            blocks.append(Block(c.hidden, c.num_heads, ffn, c.bias, c.layer_norm_eps))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps, bias=c.bias)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight


# --------------------------------------------------------------------------------------------
# Wide-ResNet
# --------------------------------------------------------------------------------------------

_RESNET_DEPTHS = {  # depth -> (blocks per stage, bottleneck blocks?)  (He et al. 2016, Table 1)
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
}


@dataclass
class WideResNetConfig:
    """Shape of a :class:`WideResNet`.

    ``stage_sizes``: blocks per stage (stage i has base width ``num_filters * 2**i`` and,
    except stage 0, starts with stride 2). ``bottleneck``: 1x1-3x3-1x1 blocks with 4x
    expansion whose 3x3 conv is ``width_factor`` times wider (Alpa's form); otherwise basic
    3x3-3x3 blocks ``width_factor`` times wider (WRN's form). ``stem``: ``"cifar"`` (3x3
    conv) or ``"imagenet"`` (7x7/2 conv + 3x3/2 max-pool).
    """

    stage_sizes: tuple[int, ...] = (1, 1, 1)
    bottleneck: bool = False
    num_filters: int = 16
    width_factor: int = 2
    image_size: int = 32
    num_classes: int = 10
    stem: str = "cifar"

    def __post_init__(self):
        self.stage_sizes = tuple(self.stage_sizes)
        if self.stem not in ("cifar", "imagenet"):
            raise ValueError(f"stem must be 'cifar' or 'imagenet', got {self.stem!r}")


class BasicBlock(nn.Module):
    """``relu(bn(conv3x3(relu(bn(conv3x3(x))))) + shortcut(x))`` (ResNet-V1 ordering)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, width_factor: int):
        super().__init__()
        cout = width * width_factor
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = _projection(cin, cout, stride)
        self.out_channels = cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class BottleneckBlock(nn.Module):
    """``1x1 (w) -> 3x3 (w * width_factor, stride) -> 1x1 (4 w)`` with BN/ReLU, plus shortcut."""

    def __init__(self, cin: int, width: int, stride: int, width_factor: int):
        super().__init__()
        mid, cout = width * width_factor, 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = _projection(cin, cout, stride)
        self.out_channels = cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.shortcut(x))


def _projection(cin: int, cout: int, stride: int) -> nn.Module:
    if cin == cout and stride == 1:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class WideResNet(nn.Module):
    """Wide ResNet classifier returning the cross-entropy loss.

    ``forward(images [B, 3, image_size, image_size] float32, labels [B] int64) -> scalar``.
    Stem, stages of :class:`BasicBlock` / :class:`BottleneckBlock`, global average pooling
    (``avg_pool2d`` over the whole map), ``Linear(channels, num_classes)``. BatchNorm runs in
    training mode (batch statistics; running statistics are buffers updated in place).
    """

    def __init__(self, config: WideResNetConfig):
        super().__init__()
        self.config = c = config
        if c.stem == "cifar":
            self.stem = nn.Sequential(nn.Conv2d(3, c.num_filters, 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(c.num_filters), nn.ReLU())
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, c.num_filters, 7, 2, 3, bias=False),
                                      nn.BatchNorm2d(c.num_filters), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
        block_cls = BottleneckBlock if c.bottleneck else BasicBlock
        cin, stages = c.num_filters, []
        for i, n in enumerate(c.stage_sizes):
            blocks = []
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                blk = block_cls(cin, c.num_filters * 2**i, stride, c.width_factor)
                blocks.append(blk)
                cin = blk.out_channels
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, c.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        x = F.avg_pool2d(x, kernel_size=x.shape[-2:]).flatten(1)
        return F.cross_entropy(self.fc(x), labels)


# --------------------------------------------------------------------------------------------
# HuggingFace wrappers
# --------------------------------------------------------------------------------------------


class LossWrapper(nn.Module):
    """Wraps a HuggingFace model: ``forward(*tensors) -> model(**dict(zip(keys, tensors))).loss``.

    ``keys`` names the model's keyword inputs in call order (default ``input_ids, labels``), so a
    positional batch reaches an HF model as HF models are called.
    """

    def __init__(self, model: nn.Module, keys: tuple[str, ...] = ("input_ids", "labels")):
        super().__init__()
        self.model = model
        self.keys = tuple(keys)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        if len(tensors) != len(self.keys):
            raise TypeError(f"{type(self.model).__name__} wrapper takes {len(self.keys)} tensors "
                            f"({', '.join(self.keys)}), got {len(tensors)}")
        return self.model(**dict(zip(self.keys, tensors))).loss


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the HuggingFace models (bert, gpt2-hf, llama, mixtral, t5, qwen2, qwen3, gemma, gemma2, opt, phi, vit) need the transformers package: "
            "pip install alpa-lite[hf]"
        ) from e
    return transformers


# --------------------------------------------------------------------------------------------
# Deterministic initialization
# --------------------------------------------------------------------------------------------


def init_weights(model: nn.Module, seed: int | None = 0, num_layers: int | None = None) -> nn.Module:
    """Re-initialize ``model`` deterministically, GPT-2 style; returns ``model``.

    Applied module by module with ``model.apply``: ``Linear`` and ``Embedding`` weights
    ~ N(0, 0.02), biases 0; LayerNorm / BatchNorm weight 1, bias 0; ``Conv2d`` Kaiming normal
    (fan_out, ReLU); :class:`MoELayer` experts N(0, 0.02). Output projections of residual
    branches (marked ``residual_out``) get std ``0.02 / sqrt(2 * num_layers)`` (GPT-2 paper,
    section 2.3); ``num_layers`` defaults to ``model.config.num_layers`` when present.
    Random numbers come from a private generator seeded with ``seed`` per device, so the
    result does not depend on (or change) the global RNG. Meta tensors are left alone.
    Tied weights are initialized once (as the embedding).
    """
    if num_layers is None:
        num_layers = getattr(getattr(model, "config", None), "num_layers", None)
    out_std = INIT_STD / math.sqrt(2 * num_layers) if num_layers else INIT_STD
    gens: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()

    def gen(t: torch.Tensor) -> torch.Generator | None:
        if seed is None:
            return None
        if t.device not in gens:
            gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        return gens[t.device]

    def fresh(p: torch.Tensor | None) -> bool:
        if p is None or p.device.type == "meta" or id(p) in seen:
            return False
        seen.add(id(p))
        return True

    @torch.no_grad()
    def init(m: nn.Module) -> None:
        if isinstance(m, MoELayer):
            if fresh(m.w1):
                m.reset_parameters(gen(m.w1), INIT_STD, out_std)
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            if fresh(m.weight):
                std = out_std if getattr(m, "residual_out", False) else INIT_STD
                nn.init.normal_(m.weight, 0.0, std, generator=gen(m.weight))
            if getattr(m, "bias", None) is not None and fresh(m.bias):
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Conv2d):
            if fresh(m.weight):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu",
                                        generator=gen(m.weight))
            if m.bias is not None and fresh(m.bias):
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.modules.batchnorm._BatchNorm)):
            if m.weight is not None and fresh(m.weight):
                nn.init.ones_(m.weight)
            if m.bias is not None and fresh(m.bias):
                nn.init.zeros_(m.bias)

    # embeddings first, so a tied lm_head keeps the embedding's N(0, 0.02)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            init(m)
    model.apply(init)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once); works on meta."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

# name -> (hidden, layers, heads); GPT-2 paper Table 2 (vocab 50257 padded to 50304, seq 1024)
_GPT2 = {"gpt2-small": (768, 12, 12), "gpt2-medium": (1024, 24, 16)}
# Alpa OSDI'22 Table 4 (GPT-3 suite): seq 1024, vocab 51200
_GPT3 = {
    "gpt3-125m": (768, 12, 12),
    "gpt3-350m": (1024, 24, 16),
    "gpt3-760m": (1536, 24, 16),
    "gpt3-1.3b": (2048, 24, 32),
    "gpt3-2.6b": (2560, 32, 32),
    "gpt3-6.7b": (4096, 32, 32),
    "gpt3-15b": (5120, 48, 40),
    "gpt3-39b": (8192, 48, 64),
}
# Alpa OSDI'22 Table 4 (MoE suite): seq 1024, vocab 32000, group size 2048: (hidden, layers, heads, experts)
_MOE = {
    "moe-380m": (768, 8, 16, 8),
    "moe-690m": (768, 8, 16, 16),
    "moe-1.3b": (768, 16, 16, 16),
    "moe-2.4b": (1024, 16, 16, 16),
    "moe-10b": (1536, 16, 16, 32),
    "moe-27b": (2048, 16, 16, 48),
}
# Alpa OSDI'22 Table 4 (Wide-ResNet suite): image 224, depth 50: (base channels, width factor)
_WRESNET = {
    "wide-resnet-250m": (160, 2),
    "wide-resnet-500m": (224, 2),
    "wide-resnet-1b": (320, 2),
    "wide-resnet-2b": (448, 2),
    "wide-resnet-4b": (640, 2),
    "wide-resnet-6.8b": (320, 16),
    "wide-resnet-13b": (320, 32),
}


def _randint(high: int, shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    """int64 ids in ``[0, high)``: zeros on meta, seeded uniform elsewhere."""
    if device.type == "meta":
        return torch.zeros(shape, dtype=torch.long, device=device)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g, dtype=torch.long, device="cpu").to(device)


def _randn(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(shape, device=device)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, device="cpu").to(device)


def _config(cls, defaults: dict, overrides: dict, name: str):
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise TypeError(f"unknown override(s) {bad} for model {name!r}; valid: {sorted(fields)}")
    return cls(**{**defaults, **overrides})


def _build_mlp(name, batch, seq, dev, seed, **ov):
    hidden = ov.pop("hidden", 256)
    model = MLP(hidden=hidden, num_layers=ov.pop("num_layers", 6), bias=ov.pop("bias", True))
    if ov:
        raise TypeError(f"unknown override(s) {sorted(ov)} for model 'mlp'; "
                        "valid: ['bias', 'hidden', 'num_layers']")
    return model, (_randn((batch, hidden), dev, seed + 1), _randn((batch, hidden), dev, seed + 2))


def _lm_inputs(vocab: int, batch: int, seq: int, dev: torch.device, seed: int):
    return _randint(vocab, (batch, seq), dev, seed + 1), _randint(vocab, (batch, seq), dev, seed + 2)


def _build_gpt(name, batch, seq, dev, seed, **ov):
    if name in _GPT2:
        (h, L, nh), vocab, dseq = _GPT2[name], 50304, 1024
    elif name in _GPT3:
        (h, L, nh), vocab, dseq = _GPT3[name], 51200, 1024
    else:  # gpt-tiny
        (h, L, nh), vocab, dseq = (64, 2, 4), 65, 64
    seq = seq or ov.get("seq_len") or dseq
    ov.setdefault("seq_len", seq)
    cfg = _config(GPTConfig, dict(vocab_size=vocab, hidden=h, num_layers=L, num_heads=nh), ov, name)
    model = GPT(cfg)
    init_weights(model, seed)
    return model, _lm_inputs(cfg.vocab_size, batch, seq, dev, seed)


def _build_moe(name, batch, seq, dev, seed, **ov):
    if name in _MOE:
        h, L, nh, E = _MOE[name]
        defaults = dict(vocab_size=32000, seq_len=1024, hidden=h, num_layers=L, num_heads=nh,
                        num_experts=E, expert_group_size=2048)
    else:  # small: MoEConfig defaults
        defaults = {}
    if seq:
        ov.setdefault("seq_len", seq)
    cfg = _config(MoEConfig, defaults, ov, name)
    model = MoETransformer(cfg)
    init_weights(model, seed)
    return model, _lm_inputs(cfg.vocab_size, batch, seq or cfg.seq_len, dev, seed)


def _build_wresnet(name, batch, seq, dev, seed, **ov):
    if name in _WRESNET:
        filters, W = _WRESNET[name]
        defaults = dict(stage_sizes=_RESNET_DEPTHS[50][0], bottleneck=True, num_filters=filters,
                        width_factor=W, image_size=224, num_classes=1024, stem="imagenet")
    else:
        defaults = {}
    depth = ov.pop("depth", None)
    if depth is not None:
        if depth not in _RESNET_DEPTHS:
            raise ValueError(f"wide-resnet depth must be one of {sorted(_RESNET_DEPTHS)}, got {depth}")
        defaults["stage_sizes"], defaults["bottleneck"] = _RESNET_DEPTHS[depth]
    cfg = _config(WideResNetConfig, defaults, ov, name)
    model = WideResNet(cfg)
    init_weights(model, seed)
    images = _randn((batch, 3, cfg.image_size, cfg.image_size), dev, seed + 1)
    labels = _randint(cfg.num_classes, (batch,), dev, seed + 2)
    return model, (images, labels)


def _hf_config(cls, defaults: dict, ov: dict):
    return cls(**{**defaults, **ov})


def _padding_mask(batch: int, seq: int, dev: torch.device) -> torch.Tensor:
    """``[batch, seq]`` int64 attention mask: row i keeps its first ``seq - (i % 4) * (seq // 4)``
    tokens (1) and pads the rest (0), so rows of one batch have different lengths."""
    lengths = seq - (torch.arange(batch, device=dev) % 4) * (seq // 4)
    return (torch.arange(seq, device=dev)[None, :] < lengths[:, None]).long()


def _build_bert(name, batch, seq, dev, seed, **ov):
    tf = _transformers()
    seq = seq or 128
    cfg = _hf_config(tf.BertConfig, dict(
        vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, max_position_embeddings=max(512, seq), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa"), ov)
    model = LossWrapper(tf.BertForMaskedLM(cfg), ("input_ids", "attention_mask", "labels"))
    ids = _randint(cfg.vocab_size, (batch, seq), dev, seed + 1)
    # every position is a valid MLM target (padding is masked out of attention, not of the loss)
    return model, (ids, _padding_mask(batch, seq, dev), ids.clone())


def _build_gpt2_hf(name, batch, seq, dev, seed, **ov):
    tf = _transformers()
    seq = seq or 64
    cfg = _hf_config(tf.GPT2Config, dict(
        vocab_size=65, n_positions=seq, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa"), ov)
    hf = tf.GPT2LMHeadModel(cfg)
    hf.loss_type = "ForCausalLM"  # HF cannot infer it from the class name (it would log a warning)
    model = LossWrapper(hf)
    ids = _randint(cfg.vocab_size, (batch, seq), dev, seed + 1)
    return model, (ids, ids.clone())  # HF shifts labels inside the loss


def _build_llama(name, batch, seq, dev, seed, **ov):
    tf = _transformers()
    seq = seq or 64
    cfg = _hf_config(tf.LlamaConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(256, seq),
        attention_dropout=0.0, use_cache=False, attn_implementation="sdpa"), ov)
    model = LossWrapper(tf.LlamaForCausalLM(cfg))
    ids = _randint(cfg.vocab_size, (batch, seq), dev, seed + 1)
    return model, (ids, ids.clone())


def _build_mixtral(name, batch, seq, dev, seed, **ov):
    tf = _transformers()
    seq = seq or 64
    cfg = _hf_config(tf.MixtralConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=max(256, seq), attention_dropout=0.0, output_router_logits=False,
        use_cache=False, attn_implementation="sdpa"), ov)
    model = LossWrapper(tf.MixtralForCausalLM(cfg))
    ids = _randint(cfg.vocab_size, (batch, seq), dev, seed + 1)
    return model, (ids, ids.clone())


def _build_t5(name, batch, seq, dev, seed, **ov):
    tf = _transformers()
    seq = seq or 32
    cfg = _hf_config(tf.T5Config, dict(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, use_cache=False, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1,
        attn_implementation="sdpa"), ov)
    model = LossWrapper(tf.T5ForConditionalGeneration(cfg), ("input_ids", "attention_mask", "labels"))
    ids = _randint(cfg.vocab_size, (batch, seq), dev, seed + 1)
    labels = _randint(cfg.vocab_size, (batch, seq // 2), dev, seed + 2)  # HF shifts them into decoder inputs
    return model, (ids, _padding_mask(batch, seq, dev), labels)


def _padded_lm_inputs(vocab: int, batch: int, seq: int, dev: torch.device, seed: int):
    """``(input_ids, attention_mask, labels)`` for a causal LM with right padding: padded positions
    (:func:`_padding_mask`) and tokens whose id is a multiple of 3 (a stand-in for a prompt kept out
    of the loss) are labelled ``-100``, HF's ignore index, so rows and microbatches count different
    numbers of tokens in the loss."""
    ids = _randint(vocab, (batch, seq), dev, seed + 1)
    mask = _padding_mask(batch, seq, dev)
    return ids, mask, ids.masked_fill((mask == 0) | (ids % 3 == 0), -100)


def _build_qwen2(name, batch, seq, dev, seed, num_items=False, **ov):
    """Qwen2 (``"qwen2"``: tied embeddings, q/k/v biases) and Qwen3 (``"qwen3"``: RMSNorm of each
    query and key head). ``num_items=True`` also passes HF Trainer's ``num_items_in_batch`` (a 0-dim
    count of the batch's labelled tokens; the loss is then their sum over it)."""
    tf = _transformers()
    seq = seq or 64
    config_cls, model_cls = ((tf.Qwen3Config, tf.Qwen3ForCausalLM) if name == "qwen3"
                             else (tf.Qwen2Config, tf.Qwen2ForCausalLM))
    cfg = _hf_config(config_cls, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=max(256, seq), attention_dropout=0.0,
        tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa"), ov)
    keys = ("input_ids", "attention_mask", "labels") + (("num_items_in_batch",) if num_items else ())
    model = LossWrapper(model_cls(cfg), keys)
    ids, mask, labels = _padded_lm_inputs(cfg.vocab_size, batch, seq, dev, seed)
    count = ((labels[:, 1:] != -100).sum(),) if num_items else ()  # HF shifts the labels
    return model, (ids, mask, labels, *count)


def _build_phi(name, batch, seq, dev, seed, **ov):
    """Phi: attention and MLP in parallel from one LayerNorm, partial rotary (half of each head)."""
    tf = _transformers()
    seq = seq or 64
    cfg = _hf_config(tf.PhiConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        partial_rotary_factor=0.5, max_position_embeddings=max(256, seq), resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0, use_cache=False, attn_implementation="sdpa"), ov)
    model = LossWrapper(tf.PhiForCausalLM(cfg), ("input_ids", "attention_mask", "labels"))
    return model, _padded_lm_inputs(cfg.vocab_size, batch, seq, dev, seed)


def _build_gemma(name, batch, seq, dev, seed, **ov):
    """Gemma (``"gemma"``: tied embeddings scaled by sqrt(hidden), GeGLU) and Gemma 2 (``"gemma2"``:
    also tanh soft-capping of attention scores and logits, sliding-window layers, sandwich norms)."""
    tf = _transformers()
    seq = seq or 64
    config_cls, model_cls = ((tf.Gemma2Config, tf.Gemma2ForCausalLM) if name == "gemma2"
                             else (tf.GemmaConfig, tf.GemmaForCausalLM))
    # Gemma 2 soft-caps attention scores, which HF runs only in its eager attention
    extra = dict(sliding_window=4, query_pre_attn_scalar=16, attn_implementation="eager") if name == "gemma2" else {}
    cfg = _hf_config(config_cls, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=max(256, seq), attention_dropout=0.0,
        use_cache=False, **{"attn_implementation": "sdpa", **extra}), ov)
    model = LossWrapper(model_cls(cfg), ("input_ids", "attention_mask", "labels"))
    return model, _padded_lm_inputs(cfg.vocab_size, batch, seq, dev, seed)


def _build_opt(name, batch, seq, dev, seed, **ov):
    tf = _transformers()
    seq = seq or 64
    cfg = _hf_config(tf.OPTConfig, dict(
        vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=64, max_position_embeddings=max(256, seq), dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, use_cache=False, pad_token_id=1, attn_implementation="sdpa"), ov)
    model = LossWrapper(tf.OPTForCausalLM(cfg), ("input_ids", "attention_mask", "labels"))
    return model, _padded_lm_inputs(cfg.vocab_size, batch, seq, dev, seed)


def _build_vit(name, batch, seq, dev, seed, **ov):
    tf = _transformers()
    cfg = _hf_config(tf.ViTConfig, dict(
        image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10,
        attn_implementation="sdpa"), ov)
    model = LossWrapper(tf.ViTForImageClassification(cfg), ("pixel_values", "labels"))
    images = _randn((batch, cfg.num_channels, cfg.image_size, cfg.image_size), dev, seed + 1)
    return model, (images, _randint(cfg.num_labels, (batch,), dev, seed + 2))


def _build_resnet(name, batch, seq, dev, seed, **ov):
    defaults = dict(stage_sizes=_RESNET_DEPTHS[18][0], bottleneck=False, num_filters=8, width_factor=1,
                    image_size=32, num_classes=10, stem="imagenet")
    return _build_wresnet(name, batch, seq, dev, seed, **{**defaults, **ov})


_BUILDERS: dict[str, Callable] = {
    "mlp": _build_mlp,
    "gpt-tiny": _build_gpt,
    **{n: _build_gpt for n in _GPT2},
    **{n: _build_gpt for n in _GPT3},
    "moe": _build_moe,
    **{n: _build_moe for n in _MOE},
    "wide-resnet": _build_wresnet,
    **{n: _build_wresnet for n in _WRESNET},
    "bert": _build_bert,
    "gpt2-hf": _build_gpt2_hf,
    "llama": _build_llama,
    "mixtral": _build_mixtral,
    "t5": _build_t5,
    "resnet": _build_resnet,
    "qwen2": _build_qwen2,
    "qwen3": _build_qwen2,
    "phi": _build_phi,
    "gemma": _build_gemma,
    "gemma2": _build_gemma,
    "opt": _build_opt,
    "vit": _build_vit,
}

MODEL_NAMES: list[str] = list(_BUILDERS)
"""Every built-in model name accepted by :func:`build_model`."""

HF_MODEL_NAMES: list[str] = ["bert", "gpt2-hf", "llama", "mixtral", "t5", "qwen2", "qwen3", "gemma", "gemma2", "opt", "phi", "vit"]
"""The built-ins that need ``transformers``."""


def _import_callable(name: str) -> Callable:
    mod_name, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model {name!r} ({e}); give 'package.module:callable' "
                         f"or one of {MODEL_NAMES}") from e
    if not callable(obj):
        raise ValueError(f"model {name!r} is not callable")
    return obj


def build_model(name: str, batch: int, seq: int | None = None, device: str | torch.device = "meta",
                **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a zoo model and its example inputs: ``(model, example_inputs)``.

    ``name``: one of :data:`MODEL_NAMES`, or ``"package.module:callable"`` (called as
    ``callable(batch=batch, seq=seq)``, plus ``device=`` and the overrides if it accepts
    them; it returns ``(model, example_inputs)``). ``batch``: global batch size.
    ``seq``: sequence length for the language models (default: the model's own; for the
    built-in GPT/MoE it also sets the size of the position table); ignored by ``mlp`` and
    ``wide-resnet`` (whose image size is the ``image_size`` override). ``device``: where
    parameters and inputs live; on ``"meta"`` nothing is allocated and ids are zeros.
    ``overrides``: config fields of the model (e.g. ``num_layers=2``, ``hidden=...``;
    ``depth=`` for wide-resnet), and ``seed`` (default 0) for weights and inputs.

    ``model(*example_inputs)`` returns the scalar training loss. The model is in training
    mode.

    Raises:
        ValueError: ``batch < 1`` or ``seq < 1``; an unknown name; a ``module:callable`` that
            does not take ``batch`` and ``seq`` (or ``**kwargs``), or the given overrides, or
            does not return ``(model, example_inputs)`` (the CLI prints these in one line).
    """
    dev = torch.device(device)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if seq is not None and seq < 1:
        raise ValueError(f"seq must be >= 1, got {seq}")
    if ":" in name:
        fn = _import_callable(name)
        params = inspect.signature(fn).parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [] if var_kw else [k for k in ("batch", "seq") if k not in params]
        if missing:
            raise ValueError(f"{name} is called as {name.rsplit(':', 1)[1]}(batch=, seq=, ...) (the CLI's --batch "
                             f"and --seq; seq may be None) and does not accept {', '.join(missing)}: its signature "
                             f"is {inspect.signature(fn)}")
        kwargs = dict(batch=batch, seq=seq)
        if var_kw or "device" in params:
            kwargs["device"] = device
        if overrides:
            if not var_kw and not set(overrides) <= set(params):
                bad = sorted(set(overrides) - set(params))
                raise ValueError(f"{name} does not accept the overrides {bad}")
            kwargs.update(overrides)
        with torch.device(dev):
            out = fn(**kwargs)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module)):
            raise ValueError(f"{name} must return (model, example_inputs), got {type(out).__name__}")
        model, inputs = out
        return model, tuple(inputs)
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)} "
                         f"(or 'package.module:callable')")
    seed = int(overrides.pop("seed", 0))
    # HF models initialize themselves from the global RNG: fork it so the build is
    # deterministic and leaves the caller's RNG state untouched.
    cuda = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(dev):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)
        model, inputs = _BUILDERS[name](name, batch, seq, dev, seed, **overrides)
    model.train()
    return model, inputs
