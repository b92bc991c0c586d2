"""Communication overlapped with compute in a traced per-rank graph (``program.py``).

The lowering traces each collective where the interpreter issues it: a
``_c10d_functional`` collective right after its input is computed, its ``wait_tensor`` right
before its value is first read, so on the plans of the test suite and the benchmarks nothing
runs between a collective and its wait. ``overlap_collectives`` moves nodes of such a graph, the
order of the collectives among themselves kept (every rank of a group issues them in the same
order, as before), in two ways:

- **Prefetch.** A collective whose inputs are computed from the graph's inputs alone (a ZeRO-3
  group's all-gather of its members' shards: placeholders, their casts and their
  concatenation) is issued, with the nodes computing its input, right after the previous
  collective's wait; the first one after the placeholders. So a layer's parameter all-gather
  runs during the layer before it: one collective ahead, as FSDP's forward prefetch (Zhao et
  al. 2023, "PyTorch FSDP", section 3.3.2).
- **Deferred wait.** A wait whose value reaches only the graph's outputs (a gradient's
  reduce-scatter or all-reduce in backward: nothing later in the graph reads it) moves, with
  the nodes reading it that stood before the point it moves to, to just before the next
  collective (or the output): the collective runs during the compute between.

Both moves keep the graph's values (a node moves only to a point where its inputs are computed
and before its readers), so the graph computes what it did. A collective with more than one
reader, or one not read by a ``wait_tensor`` alone, is left where it is.
"""
from __future__ import annotations

import torch

_WAIT = "wait_tensor"


def _functional(node: torch.fx.Node) -> str | None:
    """The name of the ``_c10d_functional`` op ``node`` calls, else None."""
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional":
        return target._opname
    return None


def _issued(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(collective, its wait)`` of ``graph``'s collectives read by one ``wait_tensor`` alone,
    in graph order."""
    pairs = []
    for node in graph.nodes:
        name = _functional(node)
        if name is not None and name != _WAIT and len(node.users) == 1:
            (wait,) = node.users
            if _functional(wait) == _WAIT:
                pairs.append((node, wait))
    return pairs


def _producers(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes computing ``node``'s inputs, when every one of them is computed from the graph's
    inputs alone by pure ops (no collective, no in-place op); else None."""
    chain, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n.op in ("placeholder", "get_attr") or n in chain:
            continue
        if n.op != "call_function" or _functional(n) is not None or (
                isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            return None
        chain.add(n)
        stack.extend(n.all_input_nodes)
    return list(chain)


def _readers(wait: torch.fx.Node) -> set[torch.fx.Node] | None:
    """Every node reading ``wait``'s value, directly or through others, when none of them is a
    collective or an in-place op and the value reaches the graph's output; else None."""
    seen, stack, output = set(), list(wait.users), False
    while stack:
        n = stack.pop()
        if n.op == "output":
            output = True
            continue
        if n in seen:
            continue
        if _functional(n) is not None or (isinstance(n.target, torch._ops.OpOverload)
                                          and n.target._schema.is_mutable):
            return None
        seen.add(n)
        stack.extend(n.users)
    return seen if output else None


def overlap_collectives(graph_module: torch.fx.GraphModule) -> dict[str, int]:
    """Reorder ``graph_module``'s nodes in place (module docstring) and recompile it.

    Returns:
        ``{"prefetched": collectives issued earlier, "deferred": waits moved later}``.
    """
    graph = graph_module.graph
    inputs = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")]
    moved = {"prefetched": 0, "deferred": 0}
    pairs = _issued(graph)
    for i, (collective, _) in enumerate(pairs):
        order = {n: j for j, n in enumerate(graph.nodes)}
        after = pairs[i - 1][1] if i else max(inputs, key=order.get, default=None)
        chain = _producers(collective)
        if after is None or chain is None or order[after] >= order[collective]:
            continue
        moving = sorted((n for n in chain if order[n] > order[after]), key=order.get) + [collective]
        if order[collective] - order[after] == len(moving):  # already just after it
            continue
        for n in moving:
            after.append(n)
            after = n
        moved["prefetched"] += 1
    for i, (_, wait) in enumerate(pairs):
        readers = _readers(wait)
        if readers is None:
            continue
        order = {n: j for j, n in enumerate(graph.nodes)}
        before = next((c for c, _ in pairs[i + 1:] if order[c] > order[wait]), graph.output_node())
        moving = [wait] + sorted((n for n in readers if order[n] < order[before]), key=order.get)
        if order[before] - order[wait] == len(moving):  # already just before it
            continue
        for n in moving:
            before.prepend(n)
        moved["deferred"] += 1
    graph.lint()
    graph_module.recompile()
    return moved


def overlap_windows(graph_module: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """Per collective read by one wait (graph order): ``(op name, compute nodes between it and
    its wait)``, compute nodes being the ``call_function`` nodes that are not collectives."""
    order = list(graph_module.graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    return [(_functional(c), sum(n.op == "call_function" and _functional(n) is None
                                 for n in order[index[c] + 1:index[w]]))
            for c, w in _issued(graph_module.graph)]
