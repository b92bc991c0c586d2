"""A BERT-like encoder with separate q, k and v ``Linear`` modules (as HuggingFace's BertSelfAttention
has): ``build(batch, seq)`` gives ``(model, (x, y))`` for ``alpa_lite.zoo.build_model("bert_layer:build")``
with this folder on ``sys.path``. Post-LN layers (BERT), an input projection so the first layer's
input needs a gradient, no key bias (see ``Layer``), loss MSE against ``y``.

``megatron_specs(layers)`` are Megatron-LM's specs for its weights on mesh axis 1 (Shoeybi et al.
2019, section 3): q, k, v and the first FFN linear column-parallel, the attention output and the
second FFN linear row-parallel (weights are ``[out, in]``)."""
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, LAYERS = 32, 4, 2


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        # no key bias: it shifts every score of a query equally, so its gradient is 0 up to
        # rounding, which AdamW's normalization turns into updates of size lr
        self.query, self.key, self.value = (nn.Linear(hidden, hidden, bias=m != "key") for m in ("query", "key", "value"))
        self.out = nn.Linear(hidden, hidden)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        B, T, H = x.shape
        q, k, v = (m(x).view(B, T, self.heads, H // self.heads).transpose(1, 2) for m in (self.query, self.key, self.value))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, H)
        x = self.ln1(x + self.out(a))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class BertLike(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))

    def forward(self, x, y):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x, y)


def build(batch: int, seq: int | None = None, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        torch.manual_seed(seed)
        model = BertLike()
        x = torch.randn(batch, seq or 8, HIDDEN, generator=g)
        y = torch.randn(batch, seq or 8, HIDDEN, generator=g)
    return model.to(device), (x.to(device), y.to(device))


def megatron_specs(layers: int = LAYERS) -> dict[str, str]:
    specs = {}
    for i in range(layers):
        for m, s in (("query", "S1R"), ("key", "S1R"), ("value", "S1R"), ("out", "RS1"), ("fc1", "S1R"), ("fc2", "RS1")):
            specs[f"layers.{i}.{m}.weight"] = s
    return specs
