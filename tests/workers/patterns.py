"""Small models, one per training pattern of public bug reports, for ``verify_cases.py``
(``"model": "patterns:NAME"``; the worker's directory is on ``sys.path``).

Each ``NAME(batch, seq, device="cpu", seed=0)`` returns ``(model, inputs)`` with ``model(*inputs)``
the scalar loss (or an output holding it), as ``alpa_lite.zoo.models.build_model`` takes a
``module:callable``. Weights come from ``seed``; so do the inputs (a new batch per seed). Every
model has ``fc1`` (hidden -> 4 hidden) and ``fc2`` (4 hidden -> hidden), so one set of
Megatron-style specs (:data:`MEGATRON`) applies to all.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, VOCAB = 16, 32
MEGATRON = {"batch_axis": 0, "param_specs": {"fc1.weight": "S1R", "fc2.weight": "RS1"}}


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Tied(_Base):
    """Weight tying under two names (``tok.weight`` is ``lm_head.weight``), ``GELU(approximate=
    "tanh")``, ``F.layer_norm`` without affine parameters."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.tok.weight
        self.act = nn.GELU(approximate="tanh")

    def forward(self, ids, targets):
        h = self.tok(ids)
        h = h + self.fc2(self.act(self.fc1(F.layer_norm(h, (HIDDEN,)))))
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), targets.flatten())


class Buffers(_Base):
    """A non-persistent buffer and a persistent one read in ``forward`` (never trained)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.linspace(0.5, 1.5, HIDDEN), persistent=False)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, HIDDEN))

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.relu(self.fc1(x * self.gain + self.shift))), y)


class InPlace(_Base):
    """In-place ops on activations: ``relu_``, ``nn.ReLU(inplace=True)``, ``add_``, ``mul_``,
    ``+=`` on a residual."""

    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x, y):
        h = self.fc1(x)
        h.mul_(0.5).add_(0.1)
        h = self.relu(h)
        out = self.fc2(h)
        out += x
        out.tanh_()
        return F.mse_loss(out, y)


class NoGrad(_Base):
    """A ``torch.no_grad()`` block in ``forward`` over the model's own weights (a self-distillation
    target), its result used as a constant."""

    def forward(self, x):
        with torch.no_grad():
            target = self.fc2(F.relu(self.fc1(x * 0.5))).softmax(-1)
        logits = self.fc2(F.relu(self.fc1(x)))
        return F.kl_div(logits.log_softmax(-1), target, reduction="batchmean")


class Masks(_Base):
    """Bool and integer inputs: a padding mask (bool, per row) turned into an
    ``F.scaled_dot_product_attention`` ``attn_mask``, ``masked_fill``, ``torch.where``, and
    ``gather`` / ``index_select`` with index inputs."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.table = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)

    def forward(self, x, keep, index, rows):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, HIDDEN // 2).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :] & keep[:, None, :, None] | torch.eye(t, dtype=torch.bool)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, HIDDEN)
        h = self.proj(h).masked_fill(~keep[..., None], 0.0)
        h = torch.where(h > 0, h, 0.1 * h) + self.table.index_select(0, rows)[:, None, :]
        h = self.fc2(F.relu(self.fc1(h)))
        picked = h.gather(-1, index[..., None]).squeeze(-1)
        return (picked ** 2).mean()


class MaskedLoss(_Base):
    """``cross_entropy(reduction="none")`` then a mean over a token mask whose count differs per
    row; returns a dict holding ``"loss"`` (and the logits)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, targets, mask):
        logits = self.head(self.fc2(F.gelu(self.fc1(self.tok(ids)))))
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return {"loss": (per_token * mask).sum() / mask.sum(), "logits": logits}


class Views(_Base):
    """Raw weights read through ``x @ w``, an ``einsum`` and ``F.linear(h, w.t())`` (one of them
    twice), and a non-contiguous view (``transpose``) between layers: a 2-stage pipeline sends it
    (its gradient's receive buffer used to keep the view's strides, and gloo's ``irecv`` refused it:
    "input tensor has to be contiguous")."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.2)
        self.w_out = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.2)

    def forward(self, x, y):
        h = torch.einsum("btd,de->bte", torch.tanh(x @ self.w_in), self.w_out)
        h = h.transpose(1, 2).reshape(h.shape[0], -1).view(h.shape[0], HIDDEN, -1).transpose(1, 2)
        h = h + self.fc2(F.relu(self.fc1(h)))
        return F.mse_loss(F.linear(h, self.w_out.t()), y)


class Unused(_Base):
    """A layer built but never called and a buffer never read (DDP's ``find_unused_parameters``
    case): one process leaves the layer's gradients None. A pipeline used to drop both from
    ``state_dict()`` (no stage held them), and ``verify`` flagged the zeros ``gradients()`` reports."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("spare_stat", torch.linspace(0, 1, HIDDEN))

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.relu(self.fc1(x))), y)


def _build(cls, seed):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls()


def _keep(batch: int, seq: int) -> torch.Tensor:
    """Row ``i`` keeps its first ``seq - 2 (i % 4)`` positions: shards hold different counts."""
    return torch.arange(seq)[None, :] < (seq - 2 * (torch.arange(batch) % 4))[:, None]


def tied(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(Tied, seed), (torch.randint(0, VOCAB, (batch, seq), generator=g),
                                torch.randint(0, VOCAB, (batch, seq), generator=g))


def _regression(cls, batch, seq, seed, target=True):
    g = _seeded(seed + 1)
    x = torch.randn(batch, seq or 8, HIDDEN, generator=g)
    return _build(cls, seed), ((x, torch.randn(batch, seq or 8, HIDDEN, generator=g)) if target else (x,))


def buffers(batch, seq=None, device="cpu", seed=0):
    return _regression(Buffers, batch, seq, seed)


def inplace(batch, seq=None, device="cpu", seed=0):
    return _regression(InPlace, batch, seq, seed)


def nograd(batch, seq=None, device="cpu", seed=0):
    return _regression(NoGrad, batch, seq, seed, target=False)


def masks(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(Masks, seed), (torch.randn(batch, seq, HIDDEN, generator=g), _keep(batch, seq),
                                 torch.randint(0, HIDDEN, (batch, seq), generator=g),
                                 torch.randint(0, VOCAB, (batch,), generator=g))


def masked_loss(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(MaskedLoss, seed), (torch.randint(0, VOCAB, (batch, seq), generator=g),
                                      torch.randint(0, VOCAB, (batch, seq), generator=g), _keep(batch, seq).float())


def views(batch, seq=None, device="cpu", seed=0):
    return _regression(Views, batch, seq, seed)


def unused(batch, seq=None, device="cpu", seed=0):
    return _regression(Unused, batch, seq, seed)


# --- sweep 3: losses whose count depends on the data, batch statistics, shared blocks, outputs ---

def _padded_targets(targets: torch.Tensor, seed: int) -> torch.Tensor:
    """``targets`` with ``-100`` (ignore_index) at a random ~40% of the positions, row 3 all
    padding: the count of valid tokens differs per row, per rank and per microbatch."""
    g = _seeded(seed + 7)
    pad = torch.rand(targets.shape, generator=g) < 0.4
    pad[3 % targets.shape[0]] = True
    return targets.masked_fill(pad, -100)


class _LM(_Base):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def logits(self, ids):
        h = self.tok(ids)
        return self.head(h + self.fc2(F.gelu(self.fc1(h))))


class CEIgnore(_LM):
    """Token cross-entropy with ``ignore_index=-100``: the mean over the valid tokens of the whole
    batch (a mean of per-rank means is wrong: the counts differ)."""

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)


class CEWeight(_LM):
    """Cross-entropy with class ``weight=`` (a buffer) and ignored tokens: the mean divides by the
    sum of the selected weights."""

    def __init__(self):
        super().__init__()
        self.register_buffer("class_w", torch.linspace(0.25, 2.0, VOCAB))

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten(), weight=self.class_w)


class CESmooth(_LM):
    """Cross-entropy with ``label_smoothing=0.1`` and ignored tokens."""

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten(), label_smoothing=0.1)


class CEWeightSmooth(CEWeight):
    """Class weights and label smoothing together."""

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten(), weight=self.class_w,
                               label_smoothing=0.1)


class CE3d(_LM):
    """Cross-entropy on ``(B, C, T)`` logits (the class dim 1), ignored tokens."""

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).transpose(1, 2), targets)


class NLL(_LM):
    """``F.nll_loss`` after ``log_softmax``, ignored tokens."""

    def forward(self, ids, targets):
        return F.nll_loss(F.log_softmax(self.logits(ids), -1).flatten(0, 1), targets.flatten())


class BN1d(_Base):
    """``BatchNorm1d`` in training mode on ``(B, C, T)``: statistics over the whole batch, running
    buffers updated."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4 * HIDDEN)

    def forward(self, x, y):
        h = self.bn(self.fc1(x).transpose(1, 2)).transpose(1, 2)
        return F.mse_loss(self.fc2(F.relu(h)), y)


class BN2d(_Base):
    """``BatchNorm2d`` in training mode on ``(B, C, 2, T / 2)``."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4 * HIDDEN)

    def forward(self, x, y):
        b, t, _ = x.shape
        h = self.fc1(x).permute(0, 2, 1).reshape(b, 4 * HIDDEN, 2, t // 2)
        h = self.bn(h).reshape(b, 4 * HIDDEN, t).permute(0, 2, 1)
        return F.mse_loss(self.fc2(F.relu(h)), y)


class BatchCenter(_Base):
    """Statistics over the batch dim in forward: ``x - x.mean(0)``."""

    def forward(self, x, y):
        h = self.fc1(x)
        h = h - h.mean(0, keepdim=True)
        return F.mse_loss(self.fc2(F.relu(h)), y)


class BatchSoftmax(_Base):
    """``softmax`` over dim 0 (the batch)."""

    def forward(self, x, y):
        h = self.fc1(x).softmax(0)
        return F.mse_loss(self.fc2(h), y)


class BatchNormalize(_Base):
    """``F.normalize`` over dim 0 (the batch)."""

    def forward(self, x, y):
        h = F.normalize(self.fc1(x), dim=0)
        return F.mse_loss(self.fc2(F.relu(h)), y)


class Norms(_Base):
    """``LayerNorm(elementwise_affine=False)``, ``Linear(bias=False)``, ``RMSNorm(eps=1e-3)``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.ln = nn.LayerNorm(4 * HIDDEN, elementwise_affine=False, eps=1e-3)
        self.rms = nn.RMSNorm(HIDDEN, eps=1e-3)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x, y):
        h = x + self.fc2(F.silu(self.ln(self.fc1(self.rms(x)))))
        return F.mse_loss(self.out(h), y)


class Albert(_Base):
    """ALBERT-style sharing: one block (``fc1``, ``fc2``, a LayerNorm) called 3 times."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        h = x
        for _ in range(3):
            h = h + self.fc2(F.gelu(self.fc1(self.ln(h))))
        return F.mse_loss(self.head(h), y)


class TupleOut(CEIgnore):
    """``forward`` returns ``(loss, logits)`` (HF ``return_dict=False``)."""

    def forward(self, ids, targets):
        logits = self.logits(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


class DictOut(CEIgnore):
    """``forward`` returns a dict with extra tensors and non-tensors."""

    def forward(self, ids, targets):
        logits = self.logits(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"logits": logits, "loss": loss, "hidden": logits.detach().mean(-1), "n": 3, "past": None}


class LeftPad(_LM):
    """Left padding: position ids from ``attention_mask.cumsum(-1)`` (HF generate style), int32
    token ids, the padded positions' targets ignored."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(16, HIDDEN)

    def forward(self, ids, mask, targets):
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        h = self.tok(ids) + self.pos(pos)
        logits = self.head(h + self.fc2(F.gelu(self.fc1(h))))
        return F.cross_entropy(logits.flatten(0, 1), targets.masked_fill(mask == 0, -100).flatten())


class PadIdx(_LM):
    """``nn.Embedding(padding_idx=0)`` (its row gets no gradient)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN, padding_idx=0, max_norm=None)

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten())


class FreqEmb(_LM):
    """``nn.Embedding(scale_grad_by_freq=True)``: a row's gradient divided by its count in the
    whole index tensor."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN, scale_grad_by_freq=True)

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten())


def _lm(cls, batch, seq, seed, pad=True):
    g, seq = _seeded(seed + 1), seq or 8
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    targets = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return _build(cls, seed), (ids, _padded_targets(targets, seed) if pad else targets)


def ce_ignore(batch, seq=None, device="cpu", seed=0):
    return _lm(CEIgnore, batch, seq, seed)


def ce_weight(batch, seq=None, device="cpu", seed=0):
    return _lm(CEWeight, batch, seq, seed)


def ce_smooth(batch, seq=None, device="cpu", seed=0):
    return _lm(CESmooth, batch, seq, seed)


def ce_weight_smooth(batch, seq=None, device="cpu", seed=0):
    return _lm(CEWeightSmooth, batch, seq, seed)


def ce_3d(batch, seq=None, device="cpu", seed=0):
    return _lm(CE3d, batch, seq, seed)


def nll(batch, seq=None, device="cpu", seed=0):
    return _lm(NLL, batch, seq, seed)


def bn1d(batch, seq=None, device="cpu", seed=0):
    return _regression(BN1d, batch, seq, seed)


def bn2d(batch, seq=None, device="cpu", seed=0):
    return _regression(BN2d, batch, seq, seed)


def batch_center(batch, seq=None, device="cpu", seed=0):
    return _regression(BatchCenter, batch, seq, seed)


def batch_softmax(batch, seq=None, device="cpu", seed=0):
    return _regression(BatchSoftmax, batch, seq, seed)


def batch_normalize(batch, seq=None, device="cpu", seed=0):
    return _regression(BatchNormalize, batch, seq, seed)


def norms(batch, seq=None, device="cpu", seed=0):
    return _regression(Norms, batch, seq, seed)


def albert(batch, seq=None, device="cpu", seed=0):
    return _regression(Albert, batch, seq, seed)


def tuple_out(batch, seq=None, device="cpu", seed=0):
    return _lm(TupleOut, batch, seq, seed)


def dict_out(batch, seq=None, device="cpu", seed=0):
    return _lm(DictOut, batch, seq, seed)


def left_pad(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g, dtype=torch.int32)
    start = torch.randint(0, seq - 1, (batch,), generator=g)  # row i: its first start[i] positions pad
    mask = (torch.arange(seq)[None, :] >= start[:, None]).long()
    return _build(LeftPad, seed), (ids, mask, torch.randint(0, VOCAB, (batch, seq), generator=g))


def pad_idx(batch, seq=None, device="cpu", seed=0):
    model, (ids, targets) = _lm(PadIdx, batch, seq, seed, pad=False)
    return model, (ids.masked_fill(targets % 3 == 0, 0), targets)


def freq_emb(batch, seq=None, device="cpu", seed=0):
    model, (ids, targets) = _lm(FreqEmb, batch, seq, seed, pad=False)
    return model, (ids % 6, targets)  # few distinct ids: counts > 1, and differ per shard


# --- ops over the dim a column-parallel fc1 splits (its output's last dim, 4 hidden) ---

class SwiGLU(_Base):
    """A fused gate/up projection split with ``chunk(2, -1)`` (LLaMA / Megatron SwiGLU): a
    column-parallel ``fc1`` must not chunk its local shard."""

    def forward(self, x, y):
        a, b = self.fc1(x).chunk(2, -1)
        h = F.silu(a) * b
        return F.mse_loss(self.fc2(torch.cat([h, b], -1)), y)


class SplitUneven(_Base):
    """``torch.split`` of ``fc1``'s output into unequal parts ``[16, 16, 32]``."""

    def forward(self, x, y):
        q, k, v = self.fc1(x).split([16, 16, 32], -1)
        h = torch.cat([torch.tanh(q * k), v, q], -1)
        return F.mse_loss(self.fc2(h), y)


class HandNorm(_Base):
    """A hand-written norm over ``fc1``'s output: ``mean``, ``var(unbiased)``, ``std``, ``amax``,
    ``logsumexp`` over the last dim."""

    def forward(self, x, y):
        h = self.fc1(x)
        h = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True) + 1e-5)
        h = h + 0.1 * h.std(-1, keepdim=True) - 0.1 * h.amax(-1, keepdim=True)
        h = h - 0.5 * torch.logsumexp(h, -1, keepdim=True)
        return F.mse_loss(self.fc2(h), y)


class Cumsum(_Base):
    """``cumsum``, ``flip`` and ``roll`` along ``fc1``'s output dim."""

    def forward(self, x, y):
        h = self.fc1(x)
        h = h.cumsum(-1) * 0.1 + h.flip(-1) - torch.roll(h, 3, -1)
        return F.mse_loss(self.fc2(torch.tanh(h)), y)


class TopK(_Base):
    """Keep the top 8 of ``fc1``'s 64 outputs per token (``topk`` then a mask; a sort too)."""

    def forward(self, x, y):
        h = self.fc1(x)
        kth = h.topk(8, -1).values[..., -1:]
        h = h * (h >= kth) + 0.01 * h.sort(-1).values
        return F.mse_loss(self.fc2(h), y)


class ReshapeMix(_Base):
    """Reshapes that cut across ``fc1``'s output dim: ``(B, T, 64) -> (B, 4 T, 16)`` and back,
    ``flatten(1)``."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(16, 16)

    def forward(self, x, y):
        b, t, _ = x.shape
        h = self.fc1(x)
        h = self.mix(h.reshape(b, 4 * t, 16)).reshape(b, t, 64)
        h = h.flatten(1).softmax(-1).view(b, t, 64) * 64
        return F.mse_loss(self.fc2(h), y)


class PartialNorm(_Base):
    """Norms of a row-parallel ``fc2``'s output (a pending partial sum): ``F.normalize``,
    ``torch.linalg.vector_norm``, ``abs().max()``."""

    def forward(self, x, y):
        h = self.fc2(F.relu(self.fc1(x)))
        h = F.normalize(h, dim=-1) + 0.1 * torch.linalg.vector_norm(h, dim=-1, keepdim=True)
        return F.mse_loss(h, y) + 0.01 * h.abs().amax()


ODD_HIDDEN, ODD_VOCAB = 27, 31


class OddDims(nn.Module):
    """Sizes no mesh axis divides: ``fc1`` 16 -> 27, vocab 31 (Megatron-LM #1754)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(ODD_VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, ODD_HIDDEN)
        self.fc2 = nn.Linear(ODD_HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, ODD_VOCAB)

    def forward(self, ids, targets):
        h = self.tok(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def swiglu(batch, seq=None, device="cpu", seed=0):
    return _regression(SwiGLU, batch, seq, seed)


def split_uneven(batch, seq=None, device="cpu", seed=0):
    return _regression(SplitUneven, batch, seq, seed)


def hand_norm(batch, seq=None, device="cpu", seed=0):
    return _regression(HandNorm, batch, seq, seed)


def cumsum(batch, seq=None, device="cpu", seed=0):
    return _regression(Cumsum, batch, seq, seed)


def topk(batch, seq=None, device="cpu", seed=0):
    return _regression(TopK, batch, seq, seed)


def reshape_mix(batch, seq=None, device="cpu", seed=0):
    return _regression(ReshapeMix, batch, seq, seed)


def partial_norm(batch, seq=None, device="cpu", seed=0):
    return _regression(PartialNorm, batch, seq, seed)


def odd_dims(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    targets = torch.randint(0, ODD_VOCAB, (batch, seq), generator=g)
    return _build(OddDims, seed), (torch.randint(0, ODD_VOCAB, (batch, seq), generator=g),
                                   _padded_targets(targets, seed))


# --- more losses and normalizations ---

class NumItems(_LM):
    """HF's gradient-accumulation fix: ``cross_entropy(reduction="sum") / num_items_in_batch``,
    the count a 0-dim tensor input computed over the whole batch outside the model."""

    def forward(self, ids, targets, num_items):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten(), reduction="sum") / num_items


class MaskedSelect(_LM):
    """An MLM loss over the selected positions only: ``logits[targets != -100]`` (a
    data-dependent shape)."""

    def forward(self, ids, targets):
        keep = targets != -100
        return F.cross_entropy(self.logits(ids)[keep], targets[keep])


class TwoLosses(_LM):
    """A token cross-entropy with ignored tokens plus an auxiliary per-element MSE (mean)."""

    def forward(self, ids, targets):
        h = self.tok(ids)
        z = self.fc2(F.gelu(self.fc1(h)))
        ce = F.cross_entropy(self.head(h + z).flatten(0, 1), targets.flatten())
        return ce + 0.5 * F.mse_loss(z, h.detach())


class Ckpt(_Base):
    """``torch.utils.checkpoint`` (non-reentrant) around the MLP block."""

    def forward(self, x, y):
        h = torch.utils.checkpoint.checkpoint(lambda t: self.fc2(F.gelu(self.fc1(t))), x, use_reentrant=False)
        return F.mse_loss(x + h, y)


class GroupInstNorm(_Base):
    """``GroupNorm(8, 64)`` and ``InstanceNorm1d(64, affine=True)`` on ``(B, C, T)`` (instance norm
    runs as a batch norm over a ``(1, B*C, T)`` view)."""

    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(8, 4 * HIDDEN)
        self.inorm = nn.InstanceNorm1d(4 * HIDDEN, affine=True)

    def forward(self, x, y):
        h = self.fc1(x).transpose(1, 2)
        h = self.inorm(self.gn(h)).transpose(1, 2)
        return F.mse_loss(self.fc2(F.relu(h)), y)


class InstRunning(BN1d):
    """``InstanceNorm1d(track_running_stats=True)``: the running buffers average the instances'
    statistics over the batch."""

    def __init__(self):
        super().__init__()
        self.bn = nn.InstanceNorm1d(4 * HIDDEN, track_running_stats=True)


class BNCumulative(BN1d):
    """``BatchNorm1d(momentum=None)``: a cumulative average, the factor ``1 / num_batches_tracked``."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4 * HIDDEN, momentum=None)


class BNNoStats(BN1d):
    """``BatchNorm1d(track_running_stats=False)``: batch statistics, no buffers."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4 * HIDDEN, track_running_stats=False)


class BNEval(BN1d):
    """A batch norm in evaluation mode (frozen statistics, as when fine-tuning a backbone)."""

    def __init__(self):
        super().__init__()
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 1.5)
        self.bn.eval()


class SyncBNConv(nn.Module):
    """``Conv2d`` + ``BatchNorm2d`` + ``ReLU`` (a ResNet stem) on images, ``fc1`` / ``fc2`` after the
    pooling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, 10)

    def forward(self, img, labels):
        h = F.relu(self.bn(self.conv(img))).mean((2, 3))
        return F.cross_entropy(self.fc2(F.relu(self.fc1(h))), labels)


def num_items(batch, seq=None, device="cpu", seed=0):
    model, (ids, targets) = _lm(NumItems, batch, seq, seed)
    return model, (ids, targets, (targets != -100).sum().float())


def masked_select(batch, seq=None, device="cpu", seed=0):
    return _lm(MaskedSelect, batch, seq, seed)


def two_losses(batch, seq=None, device="cpu", seed=0):
    return _lm(TwoLosses, batch, seq, seed)


def ckpt(batch, seq=None, device="cpu", seed=0):
    return _regression(Ckpt, batch, seq, seed)


def group_inst_norm(batch, seq=None, device="cpu", seed=0):
    return _regression(GroupInstNorm, batch, seq, seed)


def inst_running(batch, seq=None, device="cpu", seed=0):
    return _regression(InstRunning, batch, seq, seed)


def bn_cumulative(batch, seq=None, device="cpu", seed=0):
    return _regression(BNCumulative, batch, seq, seed)


def bn_no_stats(batch, seq=None, device="cpu", seed=0):
    return _regression(BNNoStats, batch, seq, seed)


def bn_eval(batch, seq=None, device="cpu", seed=0):
    return _regression(BNEval, batch, seq, seed)


def syncbn_conv(batch, seq=None, device="cpu", seed=0):
    g = _seeded(seed + 1)
    return _build(SyncBNConv, seed), (torch.randn(batch, 3, 6, 6, generator=g), torch.randint(0, 10, (batch,), generator=g))



class Convs(nn.Module):
    """Conv1d with ``padding="same"``, ``groups=2``, ``dilation=2``; a strided Conv2d; a depthwise
    Conv2d; ``nn.Upsample(scale_factor=2)``; a strided ConvTranspose2d; ``fc1`` / ``fc2`` on the
    flattened maps. The ``.padding`` convolutions, the upsampling and the transposed convolution
    had no sharding rule: they ran replicated with a warning, and under a pipeline the
    cross-entropy was reported nonlinear in the microbatches."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, padding="same", groups=2, dilation=2)
        self.c2 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(4, 4, 3, groups=4, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.ct = nn.ConvTranspose2d(4, 2, 2, stride=2)
        self.fc1 = nn.Linear(2 * 8 * 32, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, 5)

    def forward(self, x, y):
        h = F.relu(self.c1(x))                                   # (B, 8, 16)
        h = F.relu(self.c2(h.view(h.shape[0], 2, 4, 16)))        # (B, 4, 2, 8)
        h = self.up(F.relu(self.dw(h)))                          # (B, 4, 4, 16)
        h = F.relu(self.ct(h)).flatten(1)                        # (B, 2, 8, 32)
        return F.cross_entropy(self.fc2(F.relu(self.fc1(h))), y)


def convs(batch, seq=None, device="cpu", seed=0):
    g = _seeded(seed + 1)
    return _build(Convs, seed), (torch.randn(batch, 4, 16, generator=g), torch.randint(0, 5, (batch,), generator=g))


# --- inputs that are not split by rows ---

class SeqFirst(_Base):
    """Sequence-first inputs ``(T, B, H)`` (``nn.MultiheadAttention``'s and ``nn.Transformer``'s
    default ``batch_first=False``): attention over dim 0, the batch on dim 1."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)

    def forward(self, x, y):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = torch.einsum("tbd,sbd->bts", q, k).softmax(-1)
        h = x + torch.einsum("bts,sbd->tbd", att, v)
        return F.mse_loss(h + self.fc2(F.relu(self.fc1(h))), y)


class SeqFirstLocal(_Base):
    """Sequence-first ``(T, B, H)`` with a causal running mean over time (``cumsum`` on dim 0)."""

    def forward(self, x, y):
        t = x.shape[0]
        h = x.cumsum(0) / torch.arange(1, t + 1, dtype=x.dtype)[:, None, None]
        return F.mse_loss(self.fc2(F.relu(self.fc1(h))), y)


class SharedMask(Masks):
    """One ``(T, T)`` attention mask for the whole batch, passed as an input."""

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, HIDDEN // 2).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, HIDDEN)
        h = self.fc2(F.relu(self.fc1(self.proj(h))))
        return (h ** 2).mean()


class WeightInput(_LM):
    """Class weights passed as an input (``forward(ids, targets, class_w)``), not a buffer."""

    def forward(self, ids, targets, class_w):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten(), weight=class_w)


class ScalarFirst(_Base):
    """A 0-dim input first: ``forward(scale, x, y)`` (a temperature, a loss scale)."""

    def forward(self, scale, x, y):
        return F.mse_loss(self.fc2(F.relu(self.fc1(x))) * scale, y)


def seq_first(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(SeqFirst, seed), (torch.randn(seq, batch, HIDDEN, generator=g),
                                    torch.randn(seq, batch, HIDDEN, generator=g))


def seq_first_local(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(SeqFirstLocal, seed), (torch.randn(seq, batch, HIDDEN, generator=g),
                                         torch.randn(seq, batch, HIDDEN, generator=g))


def shared_mask(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(SharedMask, seed), (torch.randn(batch, seq, HIDDEN, generator=g),
                                      torch.ones(seq, seq, dtype=torch.bool).tril())


def weight_input(batch, seq=None, device="cpu", seed=0):
    model, (ids, targets) = _lm(WeightInput, batch, seq, seed)
    return model, (ids, targets, torch.linspace(0.25, 2.0, VOCAB))


def scalar_first(batch, seq=None, device="cpu", seed=0):
    model, (x, y) = _regression(ScalarFirst, batch, seq, seed)
    return model, (torch.tensor(1.5 + seed % 3), x, y)


class PosReuse(_LM):
    """A position embedding of ``arange(T)`` (replicated under a split batch) added at the input and
    again before the head: with 2 stages its lookup's output is read in both."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(16, HIDDEN)

    def forward(self, ids, targets):
        pos = self.pos(torch.arange(ids.shape[1]))
        h = self.tok(ids) + pos
        h = h + self.fc2(F.gelu(self.fc1(h)))
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h + pos).flatten(0, 1), targets.flatten())


def pos_reuse(batch, seq=None, device="cpu", seed=0):
    return _lm(PosReuse, batch, seq, seed)


class MaxNormEmb(_LM):
    """``nn.Embedding(max_norm=1.0)``: forward renormalizes, in place and without grad, the rows
    the batch looks up whose norm exceeds 1."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN, max_norm=1.0)

    def forward(self, ids, targets):
        return F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten())


class MiscLosses(_Base):
    """Losses without a token count: ``binary_cross_entropy_with_logits(pos_weight=)``,
    ``multi_margin_loss``, ``triplet_margin_loss``, ``cosine_embedding_loss``, ``smooth_l1(beta)``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pos_w", torch.linspace(0.5, 2.0, HIDDEN))

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))  # (B, T, H)
        a, p, n = h[:, 0], h[:, 1], h[:, 2]
        labels = (y[:, 0] > 0).float()
        classes = y[:, 0].abs().argmax(-1)
        sign = torch.where(y[:, 1, 0] > 0, 1.0, -1.0)
        return (F.binary_cross_entropy_with_logits(h[:, 3], labels, pos_weight=self.pos_w)
                + F.multi_margin_loss(h[:, 4], classes) + F.triplet_margin_loss(a, p, n)
                + F.cosine_embedding_loss(a, n, sign) + F.smooth_l1_loss(h, y, beta=0.5))


def max_norm_emb(batch, seq=None, device="cpu", seed=0):
    model, (ids, targets) = _lm(MaxNormEmb, batch, seq, seed, pad=False)
    with torch.no_grad():
        model.tok.weight.mul_(2.0)  # most rows above norm 1
    return model, (ids, targets)


def misc_losses(batch, seq=None, device="cpu", seed=0):
    return _regression(MiscLosses, batch, seq, seed)


# --- sweep 4: buffers of other dtypes, in-place writes into tensors made in forward, into views ---

class RoPEGQA(_Base):
    """LLaMA-style attention: rotary embeddings from real ``cos`` / ``sin`` tables in buffers, 4
    query heads over 2 key/value heads (GQA, ``repeat_interleave``), and a causal mask from a
    bool ``tril`` buffer sliced to the sequence length (verify's comparison died on the bool
    buffer: ``"abs_cpu" not implemented for 'Bool'``, on rank 0 only, and the other ranks waited
    for it in the broadcast until the collective timeout)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.kv = nn.Linear(HIDDEN, HIDDEN)
        angle = torch.outer(torch.arange(32.0), 1.0 / 10000 ** torch.arange(0, 1, 0.5)).repeat(1, 2)
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)
        self.register_buffer("causal", torch.ones(32, 32, dtype=torch.bool).tril(), persistent=False)

    def _rotate(self, u: torch.Tensor) -> torch.Tensor:
        t, (u1, u2) = u.shape[2], u.chunk(2, -1)
        return u * self.cos[:t] + torch.cat([-u2, u1], -1) * self.sin[:t]

    def forward(self, x, y):
        b, t, _ = x.shape
        q = self._rotate(self.q(x).view(b, t, 4, 4).transpose(1, 2))
        k, v = self.kv(x).view(b, t, 2, 2, 4).permute(2, 0, 3, 1, 4)
        k, v = self._rotate(k).repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        att = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
        h = (att @ v).transpose(1, 2).reshape(b, t, HIDDEN)
        return F.mse_loss(self.fc2(F.relu(self.fc1(h))), y)


class ExpandInPlace(_Base):
    """An accumulator made in forward from a constant, ``zeros(B, 1, 1).expand_as(h).clone()``,
    then written in place with activations (``add_``, ``index_put_`` through ``acc[:, rows] =``):
    under data parallelism its batch rows are a slice of the constant taken without autograd, and
    the in-place write died in torch ("A view was created in no_grad mode and is being modified
    inplace with grad mode enabled")."""

    def forward(self, x, y):
        h = self.fc1(x)
        acc = torch.zeros(x.shape[0], 1, 1).expand_as(h).clone()
        acc.add_(h)
        rows = torch.tensor([0, 2, 5])
        acc[:, rows] = acc[:, rows] * 3.0
        return F.mse_loss(self.fc2(F.relu(acc)), y)


class ViewWrite(_Base):
    """In-place writes through views of an activation: ``h[..., :8] *= 0.5`` (``mul_`` of a
    ``slice``, then ``copy_`` into a ``slice``), ``h[:, 0] = cls`` (a broadcast ``copy_`` into a
    ``select``), ``h.transpose(1, 2)[:, :4].mul_(0.5)``; ``h`` is then read whole. Under Megatron
    ``h`` is split along its last dim: the writes ran on resharded copies and never reached ``h``
    (every gradient 3e3 x its bound off, no error)."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(4 * HIDDEN) * 0.1)

    def forward(self, x, y):
        h = self.fc1(x) * 1.0
        h[..., :8] *= 0.5
        h[:, 0] = self.cls
        h.transpose(1, 2)[:, :4].mul_(0.5)
        return F.mse_loss(self.fc2(F.relu(h)), y)


class Prune(_Base):
    """Weights pruned in place in forward under ``torch.no_grad()`` (magnitude-pruning and
    lottery-ticket code): ``fc1.weight.mul_(mask)``, the last statement of the block, and
    ``fc2.weight[:, :4].zero_()``. The block's result, ``mul_``'s return, is ``fc1.weight`` itself;
    capture read it detached (``fc1.weight`` got no gradient under every plan), and a 2-stage
    pipeline wrote ``fc2.weight`` in stage 0 while stage 1 read its own stale copy."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", (torch.arange(4 * HIDDEN * HIDDEN) % 5 != 0).float().view(4 * HIDDEN, HIDDEN))

    def forward(self, x, y):
        with torch.no_grad():
            self.fc2.weight[:, :4].zero_()
            self.fc1.weight.mul_(self.mask)
        return F.mse_loss(self.fc2(F.relu(self.fc1(x))), y)


def rope_gqa(batch, seq=None, device="cpu", seed=0):
    return _regression(RoPEGQA, batch, seq, seed)


def expand_inplace(batch, seq=None, device="cpu", seed=0):
    return _regression(ExpandInPlace, batch, seq, seed)


def view_write(batch, seq=None, device="cpu", seed=0):
    return _regression(ViewWrite, batch, seq, seed)


def prune(batch, seq=None, device="cpu", seed=0):
    return _regression(Prune, batch, seq, seed)


# --- sweep 5: attention masks over split heads, a contrastive loss, an unbatched input ---

class AttnBias(_Base):
    """Attention over 4 heads from separate ``q`` / ``k`` / ``v`` projections (Megatron splits
    heads with ``q``/``k``/``v`` column- and ``o`` row-parallel): an ALiBi float bias buffer
    ``(H, T, T)`` with a sliding-window ``-inf`` fill as the float ``attn_mask``, then
    ``is_causal=True``, then a bool key-padding mask input ``(B, 1, 1, T)``."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        slopes = 2.0 ** -torch.arange(1.0, 5.0)
        pos = torch.arange(32.0)
        dist_ = pos[None, :] - pos[:, None]
        bias = slopes[:, None, None] * dist_[None]
        window = (dist_ <= 0) & (dist_ > -4)
        self.register_buffer("alibi", bias.masked_fill(~window, float("-inf")), persistent=False)

    def _heads(self, x):
        b, t, _ = x.shape
        return [f(x).view(b, t, 4, HIDDEN // 4).transpose(1, 2) for f in (self.q, self.k, self.v)]

    def forward(self, x, keep, y):
        b, t, _ = x.shape
        q, k, v = self._heads(x)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=self.alibi[:, :t, :t])
        h = x + self.o(h.transpose(1, 2).reshape(b, t, HIDDEN))
        q, k, v = self._heads(h)
        h = h + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, HIDDEN))
        q, k, v = self._heads(h)
        pad = keep[:, None, None, :]
        h = h + F.scaled_dot_product_attention(q, k, v, attn_mask=pad).transpose(1, 2).reshape(b, t, HIDDEN)
        return F.mse_loss(h + self.fc2(F.gelu(self.fc1(h))), y)


def attn_bias(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(AttnBias, seed), (torch.randn(batch, seq, HIDDEN, generator=g), _keep(batch, seq),
                                    torch.randn(batch, seq, HIDDEN, generator=g))


class Clip(_Base):
    """CLIP's contrastive loss: normalized embeddings of two views, ``logits = a @ b.T * scale``
    over the batch, ``cross_entropy`` both ways with labels ``arange(B)``, a learned 0-dim
    temperature read through ``exp`` (under ``zero_stage=3`` it had no plan: no dim to split, and
    ``exp`` takes its gradient complete, which ZeRO-2 cannot)."""

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(HIDDEN, HIDDEN)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, y):
        a = F.normalize(self.fc2(F.relu(self.fc1(x))), dim=-1)
        b = F.normalize(self.other(y), dim=-1)
        logits = a @ b.t() * self.logit_scale.exp()
        labels = torch.arange(x.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def clip(batch, seq=None, device="cpu", seed=0):
    g = _seeded(seed + 1)
    return _build(Clip, seed), (torch.randn(batch, HIDDEN, generator=g), torch.randn(batch, HIDDEN, generator=g))


class PosIds(_LM):
    """Position ids given as a second input of shape ``(T,)``, not batched: with ``T`` equal to the
    batch size, microbatches cut it too (``check_microbatch_rows`` cannot tell)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(16, HIDDEN)

    def forward(self, ids, pos, targets):
        h = self.tok(ids) + self.pos(pos)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def pos_ids(batch, seq=None, device="cpu", seed=0):
    model, (ids, targets) = _lm(PosIds, batch, seq, seed)
    return model, (ids, torch.arange(ids.shape[1]), targets)


# --- sweep 7: an autocast region inside forward ---

class Autocast(_Base):
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` inside ``forward`` around the MLP, without
    ``mixed_precision``: the sharded run rounds other partial sums to bf16 than one process does,
    and verify held it to fp32's bounds (every plan "differed", gradients 6e-5 to 2.4e-4 apart)."""

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc2(F.relu(self.fc1(x)))
        return F.mse_loss(h.float(), y)


def autocast(batch, seq=None, device="cpu", seed=0):
    return _regression(Autocast, batch, seq, seed)


# --- sweep 8b: MHA with a key-padding mask, more loss classes ---

class MHAPad(_Base):
    """``nn.MultiheadAttention(batch_first=True)`` with a bool ``key_padding_mask`` input: the
    packed q/k/v projection is ``unflatten``-ed, the mask becomes ``zeros_like(mask).masked_fill_(
    mask, -inf)``; both ran replicated without a rule, and a pipeline warned falsely that
    microbatches change the loss."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(HIDDEN, 2, batch_first=True)

    def forward(self, x, pad, y):
        h, _ = self.mha(x, x, x, key_padding_mask=pad)
        return F.mse_loss(self.fc2(F.relu(self.fc1(h))), y)


def mha_pad(batch, seq=None, device="cpu", seed=0):
    model, (x, y) = _regression(MHAPad, batch, seq, seed)
    return model, (x, ~_keep(batch, x.shape[1]), y)


class NLLWeightIgnore(CEWeight):
    """``nll_loss(weight=, ignore_index=)``: the mean divides by the class weights of the valid
    targets (a ratio of sums over microbatches and devices)."""

    def forward(self, ids, targets):
        logp = F.log_softmax(self.logits(ids), -1).flatten(0, 1)
        return F.nll_loss(logp, targets.flatten(), weight=self.class_w, ignore_index=-100)


def nll_weight_ignore(batch, seq=None, device="cpu", seed=0):
    return _lm(NLLWeightIgnore, batch, seq, seed)


class PairLosses(_Base):
    """``margin_ranking_loss`` and ``huber_loss(delta=0.5)`` (means over equal parts)."""

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))  # (B, T, H)
        sign = torch.where(y[:, 0, 0] > 0, 1.0, -1.0)
        return (F.margin_ranking_loss(h[:, 0].sum(-1), h[:, 1].sum(-1), sign, margin=0.1)
                + F.huber_loss(h, y, delta=0.5))


def pair_losses(batch, seq=None, device="cpu", seed=0):
    return _regression(PairLosses, batch, seq, seed)


# --- sweep 10: op rules under ZeRO / 2D, MoE routing, norms, attention options, frozen layers ---

class WeightNormDot(_Base):
    """``nn.utils.parametrizations.weight_norm`` (``_weight_norm`` of ``original0`` / ``original1``;
    the deprecated ``nn.utils.weight_norm`` cannot be deep-copied, torch's limit, so verify cannot
    run it) on a projection,
    then ``mv``, ``dot`` and ``vdot`` terms of a learned vector."""

    def __init__(self):
        super().__init__()
        self.wn = nn.utils.parametrizations.weight_norm(nn.Linear(HIDDEN, HIDDEN))
        self.vec = nn.Parameter(torch.randn(HIDDEN) * 0.1)

    def forward(self, x, y):
        h = self.wn(self.fc2(F.gelu(self.fc1(x))))
        score = torch.mv(h.flatten(0, 1), self.vec)
        return (F.mse_loss(h, y) + 0.1 * score.pow(2).mean() + 0.1 * torch.dot(self.vec, self.vec)
                - 0.05 * torch.vdot(self.vec, self.fc2.bias))


class MoE(_Base):
    """A top-2 mixture of 4 experts (Switch / Mixtral): router softmax, ``topk``, tokens sorted by
    their first expert (``argsort``), the experts' outputs put back with ``index_add``, the tokens
    per expert counted with ``scatter_add``; Switch's load-balancing loss ``E sum_e f_e P_e`` (f:
    the share of the whole batch's tokens routed to e, P: the mean router probability: both means
    over the batch) and ST-MoE's router z-loss ``mean(logsumexp(logits)^2)``; ``fc1`` / ``fc2`` a
    shared expert."""

    E = 4

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, self.E, bias=False)
        self.w_in = nn.Parameter(torch.randn(self.E, HIDDEN, 2 * HIDDEN) * 0.2)
        self.w_out = nn.Parameter(torch.randn(self.E, 2 * HIDDEN, HIDDEN) * 0.2)

    def forward(self, x, y):
        b, t, d = x.shape
        tok = x.reshape(b * t, d)
        logits = self.router(tok)
        probs = logits.softmax(-1)
        gate, idx = probs.topk(2, -1)
        gate = gate / gate.sum(-1, keepdim=True)
        weight = torch.zeros_like(probs).scatter_add(1, idx, gate)  # (N, E) combine weights
        expert = torch.einsum("nd,edh->neh", tok, self.w_in)
        expert = torch.einsum("neh,ehd->ned", F.gelu(expert), self.w_out)
        order = idx[:, 0].argsort()
        moved = (expert * weight[..., None]).sum(1)[order]
        out = torch.zeros_like(tok).index_add(0, order, moved)
        counts = torch.zeros(self.E).scatter_add(0, idx.flatten(), torch.ones(idx.numel()))
        balance = self.E * (counts / idx.numel() * probs.mean(0)).sum()
        z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        h = out.view(b, t, d) + self.fc2(F.gelu(self.fc1(x)))
        return F.mse_loss(h, y) + 0.01 * balance + 1e-3 * z_loss


class RMSNorms(_Base):
    """``nn.RMSNorm`` at the input and ``F.rms_norm`` with a weight over ``fc1``'s output (the dim
    Megatron splits), an ``F.normalize`` over it too, and a z-loss on the output."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.mid_w = nn.Parameter(1 + 0.1 * torch.randn(4 * HIDDEN))

    def forward(self, x, y):
        h = self.fc1(self.norm(x))
        h = F.rms_norm(h, (4 * HIDDEN,), self.mid_w, eps=1e-5) + 0.5 * F.normalize(h, dim=-1)
        out = self.fc2(F.silu(h))
        return F.mse_loss(out, y) + 1e-2 * torch.logsumexp(out, -1).pow(2).mean()


class SdpaOptions(_Base):
    """``F.scaled_dot_product_attention`` with ``scale=0.3``, ``enable_gqa=True`` (4 query heads over
    2 key/value heads) and ``is_causal=True``; heads come from ``fc1``'s output."""

    def forward(self, x, y):
        b, t, _ = x.shape
        h = self.fc1(x)  # (B, T, 64): q 32 = 4 x 8, k 16 = 2 x 8, v 16
        q, k, v = h.split([32, 16, 16], -1)
        q = q.view(b, t, 4, 8).transpose(1, 2)
        k, v = (u.reshape(b, t, 2, 8).transpose(1, 2) for u in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
        a = a.transpose(1, 2).reshape(b, t, 32)
        return F.mse_loss(self.fc2(torch.cat([a, a], -1)), y)


class AlphaBeta(_Base):
    """``addmm`` / ``baddbmm`` / ``addmv`` / ``addbmm`` with ``alpha`` and ``beta`` other than 1."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.2)
        self.bias = nn.Parameter(torch.randn(HIDDEN) * 0.1)

    def forward(self, x, y):
        b, t, d = x.shape
        h = self.fc2(F.gelu(self.fc1(x)))
        flat = torch.addmm(self.bias, h.reshape(b * t, d), self.w, beta=0.5, alpha=1.5).view(b, t, d)
        att = torch.baddbmm(torch.ones(b, t, t), flat, h.transpose(1, 2), beta=0.25, alpha=0.1).softmax(-1)
        mixed = torch.baddbmm(h, att, flat, beta=2.0, alpha=0.5)
        col = torch.addmv(self.bias, self.w, self.bias, beta=0.7, alpha=-1.2)
        return F.mse_loss(mixed + col, y)


class SeqOps(_Base):
    """Ops along the sequence and with tensor arguments: ``cumsum`` / ``cumprod`` over dim 1,
    ``repeat_interleave`` of positions, ``clamp`` with tensor bounds, ``lerp`` with a tensor
    weight, ``chunk`` of ``fc1``'s output."""

    def __init__(self):
        super().__init__()
        self.lo = nn.Parameter(-0.5 - 0.1 * torch.rand(4 * HIDDEN))
        self.register_buffer("hi", 0.5 + torch.linspace(0, 0.5, 4 * HIDDEN))
        self.mix = nn.Parameter(torch.rand(HIDDEN))

    def forward(self, x, y):
        t = x.shape[1]
        h = self.fc1(x)
        h = torch.clamp(h, min=self.lo, max=self.hi)
        a, c = h.chunk(2, -1)
        decay = torch.sigmoid(a).cumprod(1)
        h = torch.cat([c.cumsum(1) / t * decay, a], -1)
        out = self.fc2(h)
        halves = out[:, : t // 2].repeat_interleave(2, dim=1)
        return F.mse_loss(torch.lerp(out, halves, self.mix), y)


class TrainBranch(_Base):
    """``forward`` branches on ``self.training`` (a train-only scaling and noise-free jitter)."""

    def forward(self, x, y):
        h = self.fc1(x)
        if self.training:
            h = h * 0.8 + 0.05
        return F.mse_loss(self.fc2(F.relu(h)), y)


class SumLoss(_Base):
    """``mse_loss(reduction="sum")`` and a token cross-entropy with ``reduction="sum"``: the sum
    over the batch (accumulated microbatches add up)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, y, labels):
        h = self.fc2(F.gelu(self.fc1(x)))
        return (F.mse_loss(h, y, reduction="sum") * 0.01
                + F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), reduction="sum") * 0.01)


class InplaceSumLoss(SumLoss):
    """:class:`SumLoss` combined in place, as HF adds its MoE auxiliary loss (``loss += coef * aux``):
    ``loss *= 0.01``, ``loss += ...``, ``loss -= ...``, ``loss /= 2`` on the 0-dim loss (the pipeline and
    accumulation read ``add_`` as nonlinear, took the sum for a mean and averaged the microbatches'
    losses: half the loss and gradients, with a "nonlinear function of the batch" warning)."""

    def forward(self, x, y, labels):
        h = self.fc2(F.gelu(self.fc1(x)))
        loss = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), reduction="sum")
        loss *= 0.02
        loss += F.mse_loss(h, y, reduction="sum") * 0.02
        loss -= h.sum() * 1e-3
        loss /= 2
        return loss


class FrozenFirst(_Base):
    """Frozen first layers (``requires_grad_(False)``: an embedding and ``fc1``), fine-tuning
    ``fc2`` and a head (the FSDP / ZeRO-3 frozen-parameter pattern)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, HIDDEN)
        self.inp.requires_grad_(False)
        self.fc1.requires_grad_(False)

    def forward(self, x, y):
        h = F.gelu(self.inp(x))
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.mse_loss(self.head(h), y)


def weight_norm_dot(batch, seq=None, device="cpu", seed=0):
    return _regression(WeightNormDot, batch, seq, seed)


def moe(batch, seq=None, device="cpu", seed=0):
    return _regression(MoE, batch, seq, seed)


def rms_norms(batch, seq=None, device="cpu", seed=0):
    return _regression(RMSNorms, batch, seq, seed)


def sdpa_options(batch, seq=None, device="cpu", seed=0):
    return _regression(SdpaOptions, batch, seq, seed)


def alpha_beta(batch, seq=None, device="cpu", seed=0):
    return _regression(AlphaBeta, batch, seq, seed)


def seq_ops(batch, seq=None, device="cpu", seed=0):
    return _regression(SeqOps, batch, seq, seed)


def train_branch(batch, seq=None, device="cpu", seed=0):
    return _regression(TrainBranch, batch, seq, seed)


def sum_loss(batch, seq=None, device="cpu", seed=0):
    model, (x, y) = _regression(SumLoss, batch, seq, seed)
    return model, (x, y, torch.randint(0, VOCAB, x.shape[:2], generator=_seeded(seed + 3)))


def inplace_sum_loss(batch, seq=None, device="cpu", seed=0):
    model, (x, y) = _regression(InplaceSumLoss, batch, seq, seed)
    return model, (x, y, torch.randint(0, VOCAB, x.shape[:2], generator=_seeded(seed + 3)))


def frozen_first(batch, seq=None, device="cpu", seed=0):
    return _regression(FrozenFirst, batch, seq, seed)


class VocabHead(_LM):
    """Losses over a vocab-parallel head's logits (``head.weight`` split by classes, torch's
    ``loss_parallel``): cross-entropy with label smoothing, ``log_softmax`` also read by an entropy
    bonus and a ``gather`` of the targets' log-probabilities, a ``kl_div`` to a detached softened
    target and a z-loss ``logsumexp(logits)^2`` (DTensor gave identity gradients to a
    ``log_softmax`` not consumed by cross-entropy, pytorch#190746)."""

    def forward(self, ids, targets):
        logits = self.logits(ids)
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1).mean()
        picked = -logp.gather(-1, targets[..., None]).mean()
        soft = F.softmax(logits.detach() / 2.0, -1)
        return (F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1) - 0.1 * entropy
                + 0.5 * picked + F.kl_div(logp, soft, reduction="batchmean")
                + 1e-2 * torch.logsumexp(logits, -1).pow(2).mean())


class HeadsScale(AttnBias):
    """Attention over 4 heads split by Megatron ``q`` / ``k`` / ``v`` / ``o`` specs with
    ``scale=0.3`` and a float ``attn_mask`` buffer, then ``is_causal`` with the default scale."""

    def forward(self, x, keep, y):
        b, t, _ = x.shape
        q, k, v = self._heads(x)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=self.alibi[:, :t, :t].clamp(min=-1e4), scale=0.3)
        h = x + self.o(h.transpose(1, 2).reshape(b, t, HIDDEN))
        q, k, v = self._heads(h)
        h = h + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.7).transpose(1, 2)
                       .reshape(b, t, HIDDEN))
        return F.mse_loss(h + self.fc2(F.gelu(self.fc1(h))), y)


class FrozenParts(_Base):
    """Parameters frozen inside trained layers: ``fc1.bias`` and ``fc2.weight``
    (``requires_grad_(False)``, BitFit's converse), the rest trained."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.fc1.bias.requires_grad_(False)
        self.fc2.weight.requires_grad_(False)

    def forward(self, x, y):
        h = x + self.fc2(F.gelu(self.fc1(x)))
        return F.mse_loss(self.out(h), y)


def vocab_head(batch, seq=None, device="cpu", seed=0):
    return _lm(VocabHead, batch, seq, seed, pad=False)


def heads_scale(batch, seq=None, device="cpu", seed=0):
    return _build(HeadsScale, seed), attn_bias(batch, seq, device, seed)[1]


def frozen_parts(batch, seq=None, device="cpu", seed=0):
    return _regression(FrozenParts, batch, seq, seed)


class L2Penalty(_Base):
    """A loss plus a batch-independent penalty on the weights, ``1e-2 * sum ||W||^2`` (hand-written
    weight decay, a prior): under microbatches the penalty must count once per step."""

    def forward(self, x, y):
        penalty = self.fc1.weight.pow(2).sum() + self.fc2.weight.pow(2).sum()
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y) + 1e-2 * penalty


class SumPenalty(L2Penalty):
    """``reduction="sum"`` loss plus the same weight penalty (the sum grows with the batch, the
    penalty does not)."""

    def forward(self, x, y):
        penalty = self.fc1.weight.pow(2).sum() + self.fc2.weight.pow(2).sum()
        return 0.01 * F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y, reduction="sum") + 1e-2 * penalty


class ShapeDiv(_Base):
    """A mean written by hand from the input's shape: ``sum / x.shape[0]`` and ``/ len(x)``
    (export bakes the size it saw into the graph as a constant)."""

    def forward(self, x, y):
        err = (self.fc2(F.gelu(self.fc1(x))) - y).pow(2)
        return err.sum() / x.shape[0] / x.shape[1] / HIDDEN + err[:, 0].abs().sum() / len(x)


def l2_penalty(batch, seq=None, device="cpu", seed=0):
    return _regression(L2Penalty, batch, seq, seed)


def sum_penalty(batch, seq=None, device="cpu", seed=0):
    return _regression(SumPenalty, batch, seq, seed)


def shape_div(batch, seq=None, device="cpu", seed=0):
    return _regression(ShapeDiv, batch, seq, seed)


class PrefixPos(_LM):
    """Learned prefix tokens (prefix / prompt tuning: a parameter ``expand``-ed over the batch and
    ``cat``-ed before the sequence), a position table longer than the sequence sliced to it
    (``pos[:T]``), and a table indexed with the ids directly (``table[ids]``, ``aten.index``)."""

    def __init__(self):
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(3, HIDDEN) * 0.1)
        self.pos = nn.Parameter(torch.randn(32, HIDDEN) * 0.1)
        self.table = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)

    def forward(self, ids, targets):
        b, t = ids.shape
        h = self.tok(ids) + self.pos[:t] + self.table[ids]
        h = torch.cat([self.prefix.expand(b, -1, -1), h], 1)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h[:, 3:]).flatten(0, 1), targets.flatten())


class EinsumMix(_Base):
    """``einsum`` with a parameter vector (``"btd,d->bt"``), a diagonal (``"bd,bd->b"``), a batched
    outer product over two parameters (``"i,j->ij"``) and an ellipsis (``"...d,de->...e"``)."""

    def __init__(self):
        super().__init__()
        self.u = nn.Parameter(torch.randn(HIDDEN) * 0.3)
        self.v = nn.Parameter(torch.randn(HIDDEN) * 0.3)

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))
        score = torch.einsum("btd,d->bt", h, self.u)
        diag = torch.einsum("bd,bd->b", h[:, 0], x[:, 1])
        outer = torch.einsum("i,j->ij", self.u, self.v)
        mixed = torch.einsum("...d,de->...e", h, outer)
        return F.mse_loss(mixed + score[..., None], y) + 0.1 * diag.pow(2).mean()


class InputInPlace(_Base):
    """In-place writes into the model's inputs: ``x.mul_(0.5)`` and ``y.clamp_(-1, 1)`` (the caller's
    tensors change)."""

    def forward(self, x, y):
        x.mul_(0.5)
        y.clamp_(-1.0, 1.0)
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


class ItemCount(_LM):
    """A token count read with ``.item()`` (a Python number inside forward): the mean over valid
    tokens written as ``sum / count.item()``."""

    def forward(self, ids, targets):
        count = (targets != -100).sum().item()
        loss = F.cross_entropy(self.logits(ids).flatten(0, 1), targets.flatten(), reduction="sum")
        return loss / max(count, 1)


def prefix_pos(batch, seq=None, device="cpu", seed=0):
    return _lm(PrefixPos, batch, seq, seed, pad=False)


def einsum_mix(batch, seq=None, device="cpu", seed=0):
    return _regression(EinsumMix, batch, seq, seed)


def input_inplace(batch, seq=None, device="cpu", seed=0):
    return _regression(InputInPlace, batch, seq, seed)


def item_count(batch, seq=None, device="cpu", seed=0):
    return _lm(ItemCount, batch, seq, seed)


class RandomNoise(_Base):
    """Random tensors made like an activation without a gradient: ``1e-7 * randn_like(h)`` noise
    and a ``rand_like(h) > 0`` mask (all ones); small enough that one process, drawing other
    numbers, trains equal."""

    def forward(self, x, y):
        h = self.fc1(x)
        h = (h + 1e-7 * torch.randn_like(h)) * (torch.rand_like(h) > 0.0)
        return F.mse_loss(self.fc2(F.relu(h)), y)


def random_noise(batch, seq=None, device="cpu", seed=0):
    return _regression(RandomNoise, batch, seq, seed)


# --- sweep 11: sequence-shape ops, reductions and activations over the split dim, vision ops,
# embedding bags, complex rotary embeddings, more losses ---

class SeqShape(_Base):
    """Along the sequence: ``F.pad`` reflect and replicate, ``flip`` / ``roll``, ``F.interpolate``
    (linear, then back); along ``fc1``'s output (64, split by a column-parallel ``fc1``):
    ``chunk(3)`` into unequal parts ``[22, 22, 20]``."""

    def forward(self, x, y):
        t = x.shape[1]
        h = self.fc1(x)  # (B, T, 64)
        a, b, c = h.chunk(3, -1)
        h = torch.cat([c, torch.tanh(a) * b, a], -1)  # 20 + 22 + 22
        s = h.transpose(1, 2)  # (B, 64, T)
        s = F.pad(s, (2, 1), mode="reflect")[..., 1:-2] + F.pad(s, (1, 2), mode="replicate")[..., 2:-1]
        s = s + 0.5 * s.flip(-1) - 0.25 * torch.roll(s, 2, -1)
        s = F.interpolate(F.interpolate(s, scale_factor=2, mode="linear"), size=t, mode="linear")
        return F.mse_loss(self.fc2(s.transpose(1, 2)), y)


class SplitReduce(_Base):
    """Over ``fc1``'s split output: ``var`` / ``std`` with ``correction=0``, ``F.normalize``,
    ``cosine_similarity``, a 3-norm, ``softmax(dtype=float64)``, ``logsumexp``, ``amax``; and
    activations: ``glu`` over the split dim, ``mish``, ``hardswish``, a ``PReLU`` per channel (a
    parameter over the split dim)."""

    def __init__(self):
        super().__init__()
        self.prelu = nn.PReLU(4 * HIDDEN, init=0.2)
        self.up = nn.Linear(2 * HIDDEN, 4 * HIDDEN)

    def forward(self, x, y):
        h = self.fc1(x)
        n = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True, correction=0) + 1e-5)
        n = n + 0.1 * h.std(-1, correction=0, keepdim=True) + F.normalize(h, dim=-1)
        n = n + 0.1 * F.cosine_similarity(h, h.roll(1, 1), dim=-1)[..., None]
        n = n + 0.05 * torch.linalg.vector_norm(h, ord=3, dim=-1, keepdim=True)
        n = n + h.softmax(-1, dtype=torch.float64).float() - 0.01 * torch.logsumexp(h, -1, keepdim=True)
        g = self.up(F.glu(n, -1))  # (B, T, 64)
        g = F.mish(g) + F.hardswish(n) + self.prelu(g.transpose(1, 2)).transpose(1, 2)
        return F.mse_loss(self.fc2(g - 0.1 * g.amax(-1, keepdim=True)), y)


class Bilinear(_Base):
    """``nn.Bilinear`` of the MLP's output and its input."""

    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(HIDDEN, HIDDEN, HIDDEN)

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))
        return F.mse_loss(self.bil(h, x), y)


class Vision(_Base):
    """``fc1``'s output as an image ``(B, 64, 2, T / 2)``, channels split by a column-parallel
    ``fc1``: ``pixel_shuffle`` / ``pixel_unshuffle``, ``max_pool2d(return_indices=True)`` with
    ``max_unpool2d``, ``adaptive_avg_pool2d``, ``avg_pool2d(count_include_pad=False)``, a channel
    ``GroupNorm``."""

    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(4, 4 * HIDDEN)

    def forward(self, x, y):
        b, t, _ = x.shape
        img = self.fc1(x).transpose(1, 2).reshape(b, 4 * HIDDEN, 2, t // 2)
        p = F.pixel_unshuffle(F.pixel_shuffle(img, 2) * 1.5, 2)
        m, idx = F.max_pool2d(p, 2, return_indices=True)
        img = self.gn(img + p + 0.5 * F.max_unpool2d(m, idx, 2, output_size=p.shape[-2:]))
        img = img + F.avg_pool2d(img, 3, stride=1, padding=1, count_include_pad=False)
        img = img + F.adaptive_avg_pool2d(img, (1, 2)).repeat(1, 1, 2, t // 4)
        return F.mse_loss(self.fc2(F.relu(img.reshape(b, 4 * HIDDEN, t).transpose(1, 2))), y)


class EmbBag(_Base):
    """``nn.EmbeddingBag``: ``mode="mean"`` over 2-D ids (one bag per row) and ``mode="sum"`` with
    ``per_sample_weights``; an ``Embedding(padding_idx=0)``, and ``max`` over a bag of rows
    picked by ``F.embedding_bag`` with ``offsets`` from the table itself (the last bag empty)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, HIDDEN, mode="mean")
        self.wbag = nn.EmbeddingBag(VOCAB, HIDDEN, mode="sum")
        self.tok = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        self.register_buffer("rows", torch.tensor([1, 3, 5, 7, 9, 11]))
        self.register_buffer("offsets", torch.tensor([0, 2, 5, 6]))

    def forward(self, ids, y):
        w = (ids.float() + 1) / VOCAB
        bags = self.bag(ids) + self.wbag(ids, per_sample_weights=w)  # (B, H)
        fixed = F.embedding_bag(self.rows, self.tok.weight, self.offsets, mode="max", padding_idx=None)  # (4, H)
        bags = bags + fixed.sum(0)
        h = self.tok(ids) + bags[:, None]
        return F.mse_loss(self.fc2(F.gelu(self.fc1(h))), y)


class ComplexRoPE(_Base):
    """LLaMA's rotary embeddings in complex numbers: ``view_as_complex`` of pairs times a complex
    ``freqs_cis`` buffer (``torch.polar``), ``view_as_real`` back, over ``fc1``'s output as 4
    heads of 16."""

    def __init__(self, seq: int = 8):
        super().__init__()
        freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))  # (T, 8) complex64

    def forward(self, x, y):
        b, t, _ = x.shape
        h = self.fc1(x).view(b, t, 4, 16)
        z = torch.view_as_complex(h.float().reshape(b, t, 4, 8, 2))
        h = torch.view_as_real(z * self.freqs_cis[:t, None, :]).flatten(3).reshape(b, t, 4 * HIDDEN).type_as(h)
        return F.mse_loss(self.fc2(F.silu(h)), y)


class Losses11(_Base):
    """``poisson_nll_loss`` (log input and not, ``full=True``), ``hinge_embedding_loss``, ``soft_margin_loss``,
    ``multilabel_soft_margin_loss`` with class weights."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cls_w", torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))  # (B, T, H)
        sign = torch.where(y > 0, 1.0, -1.0)
        return (F.poisson_nll_loss(h, y.abs()) + F.poisson_nll_loss(h.exp(), y.abs(), log_input=False, full=True)
                + F.hinge_embedding_loss(h, sign)
                + F.soft_margin_loss(h, sign) + F.multilabel_soft_margin_loss(h[:, 0], (y[:, 0] > 0).float(),
                                                                              weight=self.cls_w))


class CTC(_Base):
    """``F.ctc_loss`` over per-token log-probabilities ``(T, B, C)``, targets of per-row lengths."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, targets, target_lengths):
        b, t, _ = x.shape
        logp = self.head(self.fc2(F.gelu(self.fc1(x)))).log_softmax(-1).transpose(0, 1)
        lengths = torch.full((b,), t, dtype=torch.long)
        return F.ctc_loss(logp, targets, lengths, target_lengths)


def seq_shape(batch, seq=None, device="cpu", seed=0):
    return _regression(SeqShape, batch, seq, seed)


def split_reduce(batch, seq=None, device="cpu", seed=0):
    return _regression(SplitReduce, batch, seq, seed)


def bilinear(batch, seq=None, device="cpu", seed=0):
    return _regression(Bilinear, batch, seq, seed)


def vision(batch, seq=None, device="cpu", seed=0):
    return _regression(Vision, batch, seq, seed)


def emb_bag(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    return _build(EmbBag, seed), (torch.randint(0, VOCAB, (batch, seq), generator=g),
                                  torch.randn(batch, seq, HIDDEN, generator=g))


def complex_rope(batch, seq=None, device="cpu", seed=0):
    model, inputs = _regression(ComplexRoPE, batch, seq, seed)
    return model, inputs


def losses11(batch, seq=None, device="cpu", seed=0):
    return _regression(Losses11, batch, seq, seed)


def ctc(batch, seq=None, device="cpu", seed=0):
    g, seq = _seeded(seed + 1), seq or 8
    x = torch.randn(batch, seq, HIDDEN, generator=g)
    lengths = 1 + torch.arange(batch) % 3  # 1..3 labels per row, no blank (0)
    targets = torch.randint(1, VOCAB, (batch, 3), generator=g)
    return _build(CTC, seed), (x, targets, lengths)


class GaussianNLL(_Base):
    """``F.gaussian_nll_loss``: torch checks ``torch.any(var < 0)`` in Python, a branch on a
    tensor's values that capture refuses (naming the line)."""

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))
        return F.gaussian_nll_loss(h, y, F.softplus(h) + 0.1)


class EmbBagOffsets(_Base):
    """DLRM-style bags given flat: ``ids`` ``(3 B,)`` and ``offsets`` ``(B,)`` into them, so neither
    input's dim 0 is a dim of samples that splits alone."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, HIDDEN, mode="sum")

    def forward(self, ids, offsets, y):
        return F.mse_loss(self.fc2(F.gelu(self.fc1(self.bag(ids, offsets)))), y)


def gaussian_nll(batch, seq=None, device="cpu", seed=0):
    return _regression(GaussianNLL, batch, seq, seed)


def emb_bag_offsets(batch, seq=None, device="cpu", seed=0):
    g = _seeded(seed + 1)
    ids = torch.randint(0, VOCAB, (3 * batch,), generator=g)
    offsets = torch.tensor(sorted(torch.randperm(3 * batch - 1, generator=g)[:batch - 1].add(1).tolist()))
    return _build(EmbBagOffsets, seed), (ids, torch.cat([torch.zeros(1, dtype=torch.long), offsets]),
                                         torch.randn(batch, HIDDEN, generator=g))


class _GradReverse(torch.autograd.Function):
    """DANN's gradient reversal: identity forward, ``-lam * g`` backward."""

    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class GradReverse(_Base):
    """A custom ``autograd.Function`` (gradient reversal, DANN) between the MLP and a domain head."""

    def __init__(self):
        super().__init__()
        self.dom = nn.Linear(HIDDEN, 2)

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))
        d = self.dom(_GradReverse.apply(h, 0.5)).mean(1)
        return F.mse_loss(h, y) + F.cross_entropy(d, (y[:, 0, 0] > 0).long())


class TensorHook(_Base):
    """``h.register_hook(fn)`` in forward: the gradient of ``fc1``'s output scaled by 0.5."""

    def forward(self, x, y):
        h = self.fc1(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        return F.mse_loss(self.fc2(F.relu(h)), y)


class SpectralNorm(_Base):
    """``parametrizations.spectral_norm`` on ``fc1`` (power iteration on ``u`` / ``v`` buffers
    written in forward) and ``fc2``."""

    def __init__(self):
        super().__init__()
        nn.utils.parametrizations.spectral_norm(self.fc1)
        nn.utils.parametrizations.spectral_norm(self.fc2)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


def grad_reverse(batch, seq=None, device="cpu", seed=0):
    return _regression(GradReverse, batch, seq, seed)


def tensor_hook(batch, seq=None, device="cpu", seed=0):
    return _regression(TensorHook, batch, seq, seed)


def spectral_norm(batch, seq=None, device="cpu", seed=0):
    return _regression(SpectralNorm, batch, seq, seed)




class ParamHook(_Base):
    """A gradient hook registered on a parameter before training (``fc1.weight.register_hook``:
    its gradient halved)."""

    def __init__(self):
        super().__init__()
        self.fc1.weight.register_hook(lambda g: g * 0.5)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.relu(self.fc1(x))), y)


class ModuleHook(ParamHook):
    """A module backward hook of the old kind (``fc1.register_backward_hook``: the gradients it
    passes on halved)."""

    def __init__(self):
        _Base.__init__(self)
        self.fc1.register_backward_hook(lambda m, gi, go: tuple(None if g is None else g * 0.5 for g in gi))


def param_hook(batch, seq=None, device="cpu", seed=0):
    return _regression(ParamHook, batch, seq, seed)


def module_hook(batch, seq=None, device="cpu", seed=0):
    return _regression(ModuleHook, batch, seq, seed)


@torch.library.custom_op("alpa_patterns::grad_reverse", mutates_args=())
def _grad_reverse_op(x: torch.Tensor, lam: float) -> torch.Tensor:
    return x.clone()


@_grad_reverse_op.register_fake
def _(x, lam):
    return torch.empty_like(x)


def _grad_reverse_setup(ctx, inputs, output):
    ctx.lam = inputs[1]


_grad_reverse_op.register_autograd(lambda ctx, g: (-ctx.lam * g, None), setup_context=_grad_reverse_setup)


class GradReverseOp(GradReverse):
    """Gradient reversal as a ``torch.library.custom_op`` with ``register_autograd`` (what
    capture's refusal of a custom ``autograd.Function`` points to)."""

    def forward(self, x, y):
        h = self.fc2(F.gelu(self.fc1(x)))
        d = self.dom(_grad_reverse_op(h, 0.5)).mean(1)
        return F.mse_loss(h, y) + F.cross_entropy(d, (y[:, 0, 0] > 0).long())


class GradPenalty(_Base):
    """A gradient penalty in forward (WGAN-GP / R1): ``torch.autograd.grad(create_graph=True)`` of
    the output with respect to the input."""

    def forward(self, x, y):
        x = x.detach().requires_grad_(True)
        out = self.fc2(F.gelu(self.fc1(x)))
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
        return F.mse_loss(out, y) + 0.1 * g.pow(2).mean()


def grad_reverse_op(batch, seq=None, device="cpu", seed=0):
    return _regression(GradReverseOp, batch, seq, seed)


def grad_penalty(batch, seq=None, device="cpu", seed=0):
    return _regression(GradPenalty, batch, seq, seed)


class SplitIndex(_Base):
    """Index ops along ``fc1``'s output dim (split by a column-parallel ``fc1``) with indices made
    in forward or fixed: ``take_along_dim`` / ``scatter`` / ``scatter_reduce`` at ``topk``
    indices, ``index_fill``, ``index_copy``, ``index_add``, ``h[..., idx] = v``, ``masked_scatter``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cols", torch.tensor([3, 17, 40, 63, 5, 33]))
        self.extra = nn.Parameter(0.1 * torch.randn(6))

    def forward(self, x, y):
        h = self.fc1(x)  # (B, T, 64)
        top = h.topk(4, -1).indices
        picked = torch.take_along_dim(h, top, -1)  # (B, T, 4)
        h = h.scatter(-1, top, picked * 2.0) + torch.zeros_like(h).scatter_reduce(-1, top, picked, "amax")
        h = h.index_fill(-1, self.cols[:2], 0.5) + h.index_copy(-1, self.cols, h[..., :6] * self.extra)
        h = h.index_add(-1, self.cols, h[..., 10:16], alpha=0.5)
        g = h.clone()
        g[..., self.cols] = g[..., self.cols] * 3.0
        g = g.masked_scatter(h > 1.0, h * 0.25)
        return F.mse_loss(self.fc2(torch.tanh(g)), y)


def split_index(batch, seq=None, device="cpu", seed=0):
    return _regression(SplitIndex, batch, seq, seed)


class DataWrites(_Base):
    """Writes through ``.data`` in forward: an EMA buffer of the batch mean
    (``self.ema.data.mul_(0.9).add_(...)``) read by the output, and WGAN's weight clipping
    (``fc2.weight.data.clamp_``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(HIDDEN))

    def forward(self, x, y):
        self.ema.data.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
        self.fc2.weight.data.clamp_(-0.1, 0.1)
        return F.mse_loss(self.fc2(F.relu(self.fc1(x - self.ema))), y)


def data_writes(batch, seq=None, device="cpu", seed=0):
    return _regression(DataWrites, batch, seq, seed)


# --- sweep 12: a post-accumulate gradient hook, dropout (verify names random ops), transformer
# layers, MHA weights, cumulative ops along the split dim, unfold, batch-dependent weights ---

class PostHook(_Base):
    """An optimizer step in backward, torch's recipe: ``fc1.weight.register_post_accumulate_grad_hook``
    (here the gradient halved once accumulated)."""

    def __init__(self):
        super().__init__()
        self.fc1.weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.relu(self.fc1(x))), y)


class Dropout(_Base):
    """``nn.Dropout(0.1)`` after ``fc1`` (verify's two runs draw other masks), and the identity
    dropouts it leaves out of its note: ``F.dropout(p=0.0)`` and ``F.dropout(training=False)``."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x, y):
        h = F.dropout(self.drop(F.relu(self.fc1(x))), 0.0, True)
        return F.mse_loss(self.fc2(F.dropout(h, 0.3, training=False)), y)


class EncoderLayers(_Base):
    """``nn.TransformerEncoderLayer(norm_first=True, dropout=0)`` (pre-norm, GELU) and a post-norm
    one with a causal mask, then the MLP."""

    def __init__(self):
        super().__init__()
        self.pre = nn.TransformerEncoderLayer(HIDDEN, 2, 32, dropout=0.0, activation="gelu", batch_first=True,
                                              norm_first=True)
        self.post = nn.TransformerEncoderLayer(HIDDEN, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, x, y):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.post(self.pre(x), src_mask=mask, is_causal=True)
        return F.mse_loss(self.fc2(F.gelu(self.fc1(h))), y)


class MHAWeights(_Base):
    """``nn.MultiheadAttention(need_weights=True)``: the head-averaged attention weights read by the
    loss (an entropy penalty), and ``average_attn_weights=False`` per-head weights."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(HIDDEN, 2, batch_first=True)

    def forward(self, x, y):
        h, w = self.mha(x, x, x, need_weights=True)
        _, wh = self.mha(h, x, x, need_weights=True, average_attn_weights=False)
        ent = -(w * (w + 1e-6).log()).sum(-1).mean() + wh[:, 1].pow(2).mean()
        return F.mse_loss(self.fc2(F.relu(self.fc1(h))), y) + 0.1 * ent


class CumSplit(_Base):
    """Cumulative ops along ``fc1``'s output dim (split by a column-parallel ``fc1``): ``cummax``,
    ``cummin``, ``logcumsumexp``; ``Tensor.unfold`` of the sequence and ``diff`` along it."""

    def forward(self, x, y):
        h = self.fc1(x)  # (B, T, 64)
        h = h.cummax(-1).values - 0.5 * h.cummin(-1).values + 0.1 * torch.logcumsumexp(h, -1)
        w = x.unfold(1, 3, 1).mean(-1)  # (B, T - 2, 16)
        d = torch.diff(x, dim=1)  # (B, T - 1, 16)
        return F.mse_loss(self.fc2(torch.tanh(h)), y) + w.pow(2).mean() * d.abs().mean()


class BatchWeights(_Base):
    """Per-sample weights from batch statistics (a focal / OHEM-style reweighting): the per-sample
    losses' softmax over the batch, detached, weights the sum."""

    def forward(self, x, y):
        per = F.mse_loss(self.fc2(F.relu(self.fc1(x))), y, reduction="none").mean((1, 2))  # (B,)
        w = torch.softmax(per.detach() * 4.0, 0)
        return (w * per).sum()


class BufCopy(_Base):
    """A buffer written with ``copy_`` from an activation under ``torch.no_grad()`` (an EMA of the
    hidden mean, read by the output: a feature-centering teacher, DINO's center)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("center", torch.zeros(4 * HIDDEN))

    def forward(self, x, y):
        h = F.relu(self.fc1(x))
        out = self.fc2(h - self.center)
        with torch.no_grad():
            self.center.copy_(0.9 * self.center + 0.1 * h.mean((0, 1)))
        return F.mse_loss(out, y)


def post_hook(batch, seq=None, device="cpu", seed=0):
    return _regression(PostHook, batch, seq, seed)


def dropout(batch, seq=None, device="cpu", seed=0):
    return _regression(Dropout, batch, seq, seed)


def encoder_layers(batch, seq=None, device="cpu", seed=0):
    return _regression(EncoderLayers, batch, seq, seed)


def mha_weights(batch, seq=None, device="cpu", seed=0):
    return _regression(MHAWeights, batch, seq, seed)


def cum_split(batch, seq=None, device="cpu", seed=0):
    return _regression(CumSplit, batch, seq, seed)


def batch_weights(batch, seq=None, device="cpu", seed=0):
    return _regression(BatchWeights, batch, seq, seed)


def buf_copy(batch, seq=None, device="cpu", seed=0):
    return _regression(BufCopy, batch, seq, seed)


class NonContigParam(_Base):
    """A parameter stored transposed (``nn.Parameter(w.t())``, strides ``(1, 32)``: a weight loaded
    from a checkpoint of the other layout) read by ``x @ w``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(0.2 * torch.randn(32, HIDDEN).t())  # (16, 32), not contiguous

    def forward(self, x, y):
        h = self.fc2(F.relu(self.fc1(x)))
        return F.mse_loss(h, y) + (h @ self.proj).pow(2).mean()


class Float64Head(_Base):
    """A head kept in float64 (``self.head.double()``: a precision-sensitive regression head) after an
    fp32 MLP, the loss in float64."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, HIDDEN).double()

    def forward(self, x, y):
        h = self.fc2(F.relu(self.fc1(x)))
        return F.mse_loss(self.head(h.double()), y.double()).float()


class Spectral(_Base):
    """Fourier layers (FNO) inside and after the MLP: ``rfft`` along the sequence, the low modes
    times complex weights (``cfloat`` parameters), ``irfft`` back. ``fc1`` is used first: its
    gradient bucket's flat buffer was fp32, and the complex gradients lost their imaginary parts."""

    def __init__(self):
        super().__init__()
        self.modes = nn.Parameter(0.3 * torch.randn(3, 4 * HIDDEN, dtype=torch.cfloat))
        self.modes_out = nn.Parameter(0.3 * torch.randn(3, HIDDEN, dtype=torch.cfloat))

    @staticmethod
    def fourier(x, modes):
        f = torch.fft.rfft(x, dim=1)  # (B, T / 2 + 1, H) complex
        f = torch.cat([f[:, :3] * modes, torch.zeros_like(f[:, 3:])], 1)
        return x + torch.fft.irfft(f, n=x.shape[1], dim=1)

    def forward(self, x, y):
        h = self.fc2(self.fourier(F.gelu(self.fc1(x)), self.modes))
        return F.mse_loss(self.fourier(h, self.modes_out), y)


class ChunkedCE(_LM):
    """A chunked cross-entropy (Liger / torchtitan's ChunkedCELoss): the sequence's logits in chunks of
    2 positions, each ``cross_entropy(reduction="sum", ignore_index=-100)``, summed and divided by the
    count of valid targets."""

    def forward(self, ids, targets):
        h = self.tok(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        total = 0.0
        for hc, tc in zip(h.split(2, 1), targets.split(2, 1)):
            total = total + F.cross_entropy(self.head(hc).flatten(0, 1), tc.flatten(), ignore_index=-100,
                                            reduction="sum")
        return total / (targets != -100).sum()


def non_contig_param(batch, seq=None, device="cpu", seed=0):
    return _regression(NonContigParam, batch, seq, seed)


def float64_head(batch, seq=None, device="cpu", seed=0):
    return _regression(Float64Head, batch, seq, seed)


def spectral(batch, seq=None, device="cpu", seed=0):
    return _regression(Spectral, batch, seq, seed)


def chunked_ce(batch, seq=None, device="cpu", seed=0):
    return _lm(ChunkedCE, batch, seq, seed)


class HalvesSum(_LM):
    """A per-token mean written as two summed halves of the sequence over the token count:
    ``(ce(first half, "sum") + ce(second half, "sum")) / targets.numel()`` (a loss computed in
    chunks to save memory), and a chunked MSE ``torch.stack(chunks).sum() / h.numel()``."""

    def forward(self, ids, targets):
        h = self.tok(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        t = h.shape[1] // 2
        ce = (F.cross_entropy(self.head(h[:, :t]).flatten(0, 1), targets[:, :t].flatten(), reduction="sum")
              + F.cross_entropy(self.head(h[:, t:]).flatten(0, 1), targets[:, t:].flatten(), reduction="sum"))
        sq = torch.stack([c.pow(2).sum() for c in h.split(3, 1)]).sum()
        return ce / targets.numel() + 0.1 * sq / h.numel()


def halves_sum(batch, seq=None, device="cpu", seed=0):
    return _lm(HalvesSum, batch, seq, seed, pad=False)


class ZeroStart(_LM):
    """A chunked cross-entropy summed from a zero tensor (``h.new_zeros(())``) over the token count
    ``targets.numel()``, plus a penalty summed from a ``torch.tensor(0.0)`` literal over
    ``h.numel()``: per-token means (read as sums with "a term that does not depend on the batch")."""

    def forward(self, ids, targets):
        h = self.tok(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        total, sq = h.new_zeros(()), torch.tensor(0.0)
        for hc, tc in zip(h.split(2, 1), targets.split(2, 1)):
            total = total + F.cross_entropy(self.head(hc).flatten(0, 1), tc.flatten(), reduction="sum")
            sq = sq + hc.pow(2).sum()
        return total / targets.numel() + 0.1 * sq / h.numel()


def zero_start(batch, seq=None, device="cpu", seed=0):
    return _lm(ZeroStart, batch, seq, seed, pad=False)


class BatchStats(_Base):
    """Losses reduced over the batch by statistics other than sums: ``nanmean`` of per-sample losses
    with NaN at ignored samples, the mean of the 3 hardest (OHEM, ``topk`` over the batch),
    ``median``, ``logsumexp`` and ``amax`` over the batch."""

    def forward(self, x, y):
        per = F.mse_loss(self.fc2(F.relu(self.fc1(x))), y, reduction="none").mean((1, 2))  # (B,)
        keep = torch.arange(per.shape[0]) % 3 != 1
        nan = torch.where(keep, per, torch.full_like(per, float("nan")))
        return (nan.nanmean() + 0.5 * per.topk(3).values.mean() + 0.1 * per.median() + 0.1 * per.logsumexp(0)
                + 0.1 * per.amax() + 0.1 * nan.nansum())


def batch_stats(batch, seq=None, device="cpu", seed=0):
    return _regression(BatchStats, batch, seq, seed)
