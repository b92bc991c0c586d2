"""Small models for the rules whose local variants communicate (``test_op_rules_ranks.py``),
called as ``"op_models:NAME"`` by ``verify_cases.py`` (its directory is on ``sys.path``).

Each ``NAME(batch, seq, device="cpu", seed=0)`` returns ``(model, inputs)`` with ``model(*inputs)``
the scalar loss; weights and inputs come from ``seed``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, VOCAB = 16, 8192


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class VocabHead(nn.Module):
    """Embedding, a bias-free LM head (vocab-parallel when ``head.weight`` is ``S1R``) and
    cross-entropy with ``ignore_index`` hits and label smoothing (``reduction`` as given)."""

    def __init__(self, reduction: str):
        super().__init__()
        self.reduction = reduction
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, targets):
        logits = self.head(torch.tanh(self.fc(self.tok(ids)))).flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), ignore_index=3, label_smoothing=0.1,
                               reduction=self.reduction)


class ConvBN(nn.Module):
    """A grouped convolution, a synchronized batch norm (training) and a depthwise convolution
    with a bias."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, groups=2, bias=False)  # a bias before BN has no gradient
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, x, y):
        return F.mse_loss(self.dw(F.relu(self.bn(self.conv(x)))).mean((2, 3)), y)


class ConvGN(nn.Module):
    """A convolution, a group norm (split by whole groups when the convolution's output channels
    are) and an instance norm without running statistics (split by sample and channel)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True)

    def forward(self, x, y):
        return F.mse_loss(self.inorm(F.relu(self.gn(self.conv(x)))).mean((2, 3)), y)


class Sorts(nn.Module):
    """Reductions, scans and sorts along the features of a batch of rows: logsumexp (a z-loss),
    top-k, sort, cumprod, flip, roll, a vector norm and a cosine similarity."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        h = torch.tanh(self.fc(x))
        top = h.topk(4, dim=-1).values.sum(-1) + h.sort(dim=-1, descending=True).values[..., :2].sum(-1)
        scan = (1 + 0.1 * h).cumprod(-1).flip(-1).roll(1, -1).mean(-1)
        z = torch.logsumexp(h, dim=-1) + torch.linalg.vector_norm(h, dim=-1) + F.cosine_similarity(h, x, dim=-1)
        return F.mse_loss(top + scan + z, y) + 1e-2 * torch.logsumexp(h, -1).pow(2).mean()


def _build(cls, seed, *args):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls(*args)


def _lm(reduction, batch, seq, seed):
    g = _seeded(seed + 1)
    return _build(VocabHead, seed, reduction), (torch.randint(0, VOCAB, (batch, seq or 4), generator=g),
                                                torch.randint(0, VOCAB, (batch, seq or 4), generator=g))


def vocab_mean(batch, seq=None, device="cpu", seed=0):
    return _lm("mean", batch, seq, seed)


def vocab_sum(batch, seq=None, device="cpu", seed=0):
    return _lm("sum", batch, seq, seed)


def conv_bn(batch, seq=None, device="cpu", seed=0):
    g = _seeded(seed + 1)
    return _build(ConvBN, seed), (torch.randn(batch, 4, 5, 5, generator=g), torch.randn(batch, 8, generator=g))


def conv_gn(batch, seq=None, device="cpu", seed=0):
    g = _seeded(seed + 1)
    return _build(ConvGN, seed), (torch.randn(batch, 4, 5, 5, generator=g), torch.randn(batch, 8, generator=g))


def sorts(batch, seq=None, device="cpu", seed=0):
    g = _seeded(seed + 1)
    return _build(Sorts, seed), (torch.randn(batch, HIDDEN, generator=g), torch.randn(batch, generator=g))
