"""ZeRO stages as per-parameter choices of the intra-op ILP, jointly with each parameter's
tensor-parallel storage spec (ZeRO: Rajbhandari et al., SC'20, section 5; docs/planner.md).

A parameter's strategies (``strategies.placeholder_strategies``) are its storage specs. For each
storage spec ``P`` and each set ``A`` of mesh axes (of more than one device) that ``P`` does not
split, ``add_zero_strategies`` adds two strategies, both storing the parameter in ``P``:

- ZeRO-1 over ``A``: the optimizer states are partitioned over the devices of ``A``; the gradient
  is all-reduced over ``A`` (bucketed, as for a replicated parameter), each device updates its
  ``1/|A|`` slice of the (flattened) local parameter, and the updated parameter is all-gathered
  over ``A`` once per step;
- ZeRO-2 over ``A``: the gradients are partitioned too: the all-reduce becomes a reduce-scatter.

Prices: memory ``training_state_bytes`` (parameter, gradient and Adam states separately); time:
the AdamW update of the slice (the strategy's compute), the all-gather of the parameter (its
comm: the bandwidth term and its share ``min(1, b / bucket_bytes)`` of a bucket's latency,
``LogicalMesh.bucketed_cost``: the plan all-gathers the updated parameters in buckets of at most
``bucket_bytes`` after the optimizer step, one latency each, which nothing hides; the cost
graph's fixed charge pays one latency, so ``n`` buckets pay at most ``n + 1`` latencies), and on
each use edge the gradient sync
(``ReshardCosts``): every use must be a data-parallel
gradient sync over exactly ``A``, any other pairing costs ``math.inf`` and the ILP forbids it.
ZeRO-3 needs no new strategy: it is a storage spec split along axes its uses all-gather (forward,
and again for backward; reduce-scatter of the gradient), which the ILP already prices;
``zero_stages`` names it after the solve.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace

from ..core.capture import CapturedGraph
from ..core.mesh import LogicalMesh
from ..core.plan import NodePlan, local_bytes
from .strategies import ADAM_UPDATE_BYTES_FACTOR, NodeStrategies, training_state_bytes


def add_zero_strategies(cg: CapturedGraph, table: dict[str, NodeStrategies], mesh: LogicalMesh,
                        bucket_bytes: float, params: Collection[str] | None = None) -> None:
    """Add the ZeRO-1 and ZeRO-2 strategies (module docstring; ``bucket_bytes``: the plan's
    bucket size, bytes) of every trainable parameter in ``table`` that some op uses (of those
    placeholders in ``params``; None: all), in place."""
    for ph in cg.param_fqns:
        if ph not in table or not cg.node(ph).users or params is not None and ph not in params:
            continue
        val = cg.node(ph).meta["val"]
        extra = []
        for s in table[ph].strategies:
            free = [a for a in (0, 1) if mesh.shape[a] > 1 and a not in s.out_spec.axes()]
            local = local_bytes(val, s.out_spec, mesh.shape)
            for axes in [(a,) for a in free] + ([tuple(free)] if len(free) == 2 else []):
                n = math.prod(mesh.shape[a] for a in axes)
                update = mesh.compute_cost(0.0, ADAM_UPDATE_BYTES_FACTOR * local / n)
                gather = mesh.bucketed_cost("all-gather", local, axes, bucket_bytes)
                extra += [replace(s, name=f"{s.name} ZeRO-{stage}@{''.join(map(str, axes))}", compute=update,
                                  comm=gather, memory=sum(training_state_bytes(local, stage, n)),
                                  zero_stage=stage, zero_axes=axes) for stage in (1, 2)]
        table[ph].strategies.extend(extra)


def zero_stages(cg: CapturedGraph, nodes: dict[str, NodePlan]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Parameter FQN (every name of a tied weight) -> ``(ZeRO stage, mesh axes)`` of the chosen
    strategies ``nodes``: stage 1 or 2 as chosen; 3 for storage split along axes some use
    all-gathers (those axes); else ``(0, ())``."""
    gathered: dict[str, set[int]] = {ph: set() for ph in cg.param_fqns}
    for np_ in nodes.values():
        for src, spec in zip(np_.inputs, np_.in_specs):
            if src in gathered:
                gathered[src] |= nodes[src].out_specs[0].axes() - spec.axes()
    out = {}
    for ph, fqn in cg.param_fqns.items():
        np_ = nodes[ph]
        stage = ((np_.zero_stage, np_.zero_axes) if np_.zero_stage else
                 (3, tuple(sorted(gathered[ph]))) if gathered[ph] else (0, ()))
        for name in [fqn, *cg.tied.get(fqn, [])]:
            out[name] = stage
    return out
