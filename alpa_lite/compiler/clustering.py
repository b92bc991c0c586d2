"""Layer clustering (Zheng et al., OSDI'22, section 5.2): cut the captured forward graph into
layers of balanced FLOPs with few cross-layer bytes.

The non-placeholder nodes, in topological order, are first
grouped into *atoms*: maximal runs of nodes of the same module (``blocks.3``, or a top-level
module such as ``wte``), read from ``nn_module_stack``, so layer boundaries fall on module
boundaries. With ``f_a`` the forward FLOPs of atom ``a`` and ``c_p`` the bytes of values
produced at or before atom ``p`` and consumed after it, a DP over atoms picks ``L - 1`` cuts

    minimize  sum_{cuts p} c_p    subject to   avg / (1 + delta) <= FLOPs(layer) <= (1 + delta) avg,
                                               avg = sum_a f_a / L,

with ``delta`` the smallest of 0.1, 0.25, 0.5, 1, 2, inf that is feasible. A parameter belongs
to the layer of its first consumer (a tied weight used by two layers is held by both). A
parameter or buffer the forward writes (a weight pruned in place under ``torch.no_grad()``, a
queue buffer) is not cut from its readers: its write and every op reading it fall in one layer
(a stage wrote its own copy, the other stage's readers read the stale one).
"""
from __future__ import annotations

import itertools
import math
import operator
import re
from dataclasses import dataclass

import numpy as np
import torch

from ..core.capture import nbytes_of
from .ops import flops, signature
from .stage_dp import PipelinePlanError


@dataclass(frozen=True)
class Layer:
    """A contiguous run of graph nodes.

    Attributes:
        nodes: non-placeholder node names in topological order.
        placeholders: parameter / buffer / input placeholders its nodes consume.
        flops: forward FLOPs (``ops.flops``).
        modules: the module names of its atoms (``blocks.3``, ``wte`` ...), for display.
    """

    nodes: tuple[str, ...]
    placeholders: tuple[str, ...]
    flops: float
    modules: tuple[str, ...]


_NUMBERED = re.compile(r"^(.*?\.\d+)(\.|$)")
LAYER_DELTAS = (0.1, 0.25, 0.5, 1.0, 2.0, math.inf)


def _module_key(node) -> str:
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    path = path[len("model."):] if path.startswith("model.") else ("" if path == "model" else path)
    m = _NUMBERED.match(path)
    return m.group(1) if m else path.split(".")[0]


def _node_flops(node) -> float:
    return flops(node, signature(node))


def written_state(cg) -> list[tuple[str, str]]:
    """``(node, placeholder)`` of each parameter or buffer the forward writes: the node computing
    its new value (``CapturedGraph.param_mutations``, ``buffer_mutations``) and its placeholder."""
    buffers = {fqn: ph for ph, fqn in cg.buffer_fqns.items()}
    return [*cg.param_mutations.items(), *((n, buffers[fqn]) for n, fqn in cg.buffer_mutations.items())]


def cluster_layers(cg, num_layers: int | None = None, max_layers: int = 16) -> list:
    """Cut the captured graph into layers of balanced FLOPs with few cross-layer bytes.

    Args:
        cg: a ``CapturedGraph``.
        num_layers: L; None: ``min(atoms, max_layers)``.

    Returns:
        ``L`` ``Layer`` objects in pipeline order.

    Raises:
        PipelinePlanError: ``num_layers`` exceeds the number of possible cuts (the message gives it).
    """
    nodes = [n for n in cg.graph.nodes if n.op == "call_function"]
    position = {n.name: i for i, n in enumerate(nodes)}
    atoms: list[list] = []
    keys: list[str] = []
    for n in nodes:
        key = _module_key(n)
        if not atoms or key != keys[-1]:
            atoms.append([])
            keys.append(key)
        atoms[-1].append(n)
    atom_of = {n.name: a for a, group in enumerate(atoms) for n in group}
    A = len(atoms)
    # cut after atom p is allowed unless a non-tensor value or a getitem's parent crosses it
    cut_bytes = np.zeros(A)
    blocked = np.zeros(A, dtype=bool)
    for n in nodes:
        users = [u for u in n.users if u.name in position]
        if not users:
            continue
        first, last = atom_of[n.name], max(atom_of[u.name] for u in users)
        if last == first:
            continue
        val = n.meta.get("val")
        crossing_ok = isinstance(val, torch.Tensor) and not any(u.target is operator.getitem for u in users)
        if crossing_ok:
            cut_bytes[first:last] += nbytes_of(val)
        else:
            blocked[first:last] = True
    for name, ph in written_state(cg):
        spots = [atom_of[name]] + [atom_of[u.name] for u in cg.node(ph).users if u.name in atom_of]
        blocked[min(spots):max(spots)] = True
    blocked[A - 1] = False
    f = np.array([sum(_node_flops(n) for n in group) for group in atoms])
    allowed = [p for p in range(A - 1) if not blocked[p]]
    limit = len(allowed) + 1
    L = min(limit, max_layers) if num_layers is None else num_layers
    if not 1 <= L <= limit:
        raise PipelinePlanError(f"num_layers={num_layers}: this graph has {limit} possible layers at module "
                                f"boundaries (1 <= num_layers <= {limit})")
    prefix = np.concatenate([[0.0], np.cumsum(f)])
    ends = allowed + [A - 1]  # layer may end after these atoms
    cuts = None
    for delta in LAYER_DELTAS:
        avg = prefix[-1] / L
        cuts = _cluster_dp(ends, prefix, cut_bytes, L, (1 + delta) * avg, avg / (1 + delta))
        if cuts is not None:
            break
    bounds = [0] + [c + 1 for c in cuts] + [A]
    layers = []
    for a, z in itertools.pairwise(bounds):
        group = [n for atom in atoms[a:z] for n in atom]
        ph = []
        for n in group:
            for inp in n.all_input_nodes:
                if inp.op == "placeholder" and inp.name not in ph:
                    ph.append(inp.name)
        layers.append(Layer(tuple(n.name for n in group), tuple(ph), float(prefix[z] - prefix[a]),
                            tuple(dict.fromkeys(k for k in keys[a:z] if k))))
    # a parameter or buffer no op reads (a layer built but not called) goes with the first layer:
    # a pipeline stage then holds it, so that the trainer's state_dict, save_full and checkpoints
    # keep it (no stage did: they dropped it)
    unread = tuple(n.name for n in cg.graph.nodes if n.op == "placeholder" and not n.users
                   and (n.name in cg.param_fqns or n.name in cg.buffer_fqns))
    if unread and layers:
        first = layers[0]
        layers[0] = Layer(first.nodes, first.placeholders + unread, first.flops, first.modules)
    return layers


def _cluster_dp(ends, prefix, cut_bytes, L, cap, floor):
    """Cuts (atom indices a layer ends after, last one excluded) minimizing the summed cut bytes
    with every layer's FLOPs in ``[floor, cap]``; None when infeasible."""
    E = len(ends)
    INF = math.inf
    best = np.full((L + 1, E), INF)  # best[l, e]: l layers covering atoms up to ends[e]
    back = np.full((L + 1, E), -1, dtype=np.int64)
    for e in range(E):
        if floor <= prefix[ends[e] + 1] <= cap:
            best[1, e] = 0.0 if e == E - 1 else cut_bytes[ends[e]]
    for l in range(2, L + 1):
        for e in range(E):
            own = 0.0 if e == E - 1 else cut_bytes[ends[e]]
            for p in range(e):
                if best[l - 1, p] < INF and floor <= prefix[ends[e] + 1] - prefix[ends[p] + 1] <= cap:
                    v = best[l - 1, p] + own
                    if v < best[l, e]:
                        best[l, e], back[l, e] = v, p
    if best[L, E - 1] == INF:
        return None
    cuts, e, l = [], E - 1, L
    while l > 1:
        e = int(back[l, e])
        cuts.append(ends[e])
        l -= 1
    return cuts[::-1]


def crossing_values(cg, layers) -> list[list[tuple[str, int]]]:
    """Per cut ``c`` (before layer ``c``, ``0 .. L``): ``(name, layer)`` of every value produced by
    a layer before ``c`` and consumed at or after it (placeholders excluded), graph order."""
    layer_of = {n: i for i, layer in enumerate(layers) for n in layer.nodes}
    out: list[list[tuple[str, int]]] = [[] for _ in range(len(layers) + 1)]
    for name, i in layer_of.items():
        users = [layer_of[u.name] for u in cg.node(name).users if u.name in layer_of]
        for c in range(i + 1, max(users, default=i) + 1):
            out[c].append((name, i))
    return out
