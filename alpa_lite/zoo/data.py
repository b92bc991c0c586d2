"""Training data: the character-level tinyshakespeare corpus.

``alpa_lite/zoo/data/tinyshakespeare.txt`` (1,115,394 bytes, 65 distinct characters) is the
"tiny shakespeare" text of the char-rnn project (Karpathy, ``data/tinyshakespeare/input.txt``),
public-domain text of Shakespeare's plays, shipped as package data.

Typical use::

    text = load_text()
    tok = CharTokenizer(text)                 # tok.vocab_size == 65
    tokens = tok.encode_tensor(text)          # int64 [N]
    for idx, targets in batches(tokens, batch=8, seq=64, seed=0):
        loss = model(idx, targets)            # e.g. build_model("gpt-tiny", 8, 64)
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

import torch

__all__ = ["DATA_FILE", "load_text", "CharTokenizer", "batches", "load_tokens"]

DATA_FILE = "tinyshakespeare.txt"


def _data_path(name: str) -> Path | None:
    try:
        p = resources.files("alpa_lite.zoo").joinpath("data", name)
        if p.is_file():
            return Path(str(p))
    except Exception:  # namespace package, zipped install, ...: fall back to the path below
        pass
    p = Path(__file__).resolve().parent / "data" / name
    return p if p.is_file() else None


def load_text(name: str = DATA_FILE) -> str:
    """The packaged corpus ``alpa_lite/zoo/data/<name>`` as a string (UTF-8)."""
    path = _data_path(name)
    if path is None:
        raise FileNotFoundError(f"packaged data file alpa_lite/zoo/data/{name} not found; reinstall alpa-lite")
    return path.read_text(encoding="utf-8")


class CharTokenizer:
    """Character-level tokenizer: the vocabulary is the sorted set of characters of ``text``.

    ``encode(str) -> list[int]``, ``decode(ids) -> str``; ``encode_tensor`` gives an int64
    tensor. For tinyshakespeare the vocabulary has 65 symbols (``'\\n'``, ``' '``,
    punctuation, digits ``'3'``, ``A-Z``, ``a-z``).
    """

    def __init__(self, text: str | None = None):
        if text is None:
            text = load_text()
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}
        self.itos: dict[int, str] = dict(enumerate(self.chars))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.itos[int(i)] for i in ids)


def load_tokens(name: str = DATA_FILE) -> tuple[CharTokenizer, torch.Tensor]:
    """``(tokenizer, tokens)`` of the packaged corpus; tokens is int64 ``[N]``."""
    text = load_text(name)
    tok = CharTokenizer(text)
    return tok, tok.encode_tensor(text)


def batches(tokens: torch.Tensor | Sequence[int], batch: int, seq: int, seed: int = 0,
            num_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random training windows: yields ``(idx, targets)``, both int64 ``[batch, seq]`` on CPU.

    Each row is a window ``tokens[o : o + seq]`` at a uniformly random offset ``o`` and its
    target is the same window shifted by one, ``tokens[o + 1 : o + seq + 1]``. The offsets
    come from a private ``torch.Generator`` seeded with ``seed``, so the stream is a
    deterministic function of ``(tokens, batch, seq, seed)`` and independent of the global
    RNG. Endless unless ``num_batches`` is given.
    """
    data = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens))
    data = data.reshape(-1).to(dtype=torch.long, device="cpu")
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    n_start = data.numel() - seq  # valid offsets: 0 .. N - seq - 1
    if n_start < 1:
        raise ValueError(f"need more than seq + 1 = {seq + 1} tokens, got {data.numel()}")
    g = torch.Generator().manual_seed(seed)
    cols = torch.arange(seq)
    i = 0
    while num_batches is None or i < num_batches:
        offsets = torch.randint(0, n_start, (batch, 1), generator=g)
        pos = offsets + cols  # [batch, seq]
        yield data[pos], data[pos + 1]
        i += 1
