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
