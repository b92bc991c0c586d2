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
