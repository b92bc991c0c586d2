"""Forced choices on a strategy table: forced parameter and input specs, data parallelism, a
batch axis. One module for the intra-op pass and every stage of the inter-op pass, so both
read the same options the same way (``PlanOptions``)."""
from __future__ import annotations

import math

from ..core.options import PlanOptions
from ..core.spec import ShardingSpec
from .ops import HEAVY_TARGETS
from .strategies import NodeStrategies


def restrict(ns: NodeStrategies, keep) -> None:
    """Keep the strategies of ``ns`` for which ``keep(strategy)`` holds.

    Raises:
        ValueError: none is left.
    """
    kept = [s for s in ns.strategies if keep(s)]
    if not kept:
        raise ValueError(f"the forced specs leave no strategy for {ns.node}")
    ns.strategies[:] = kept


def force(ns: NodeStrategies, spec: ShardingSpec, what: str, cg, mesh) -> None:
    """Keep only the strategies of ``ns`` whose result is in ``spec`` (``what`` names the tensor).

    Raises:
        ValueError: ``spec`` does not fit or divide the tensor on ``mesh``, or no strategy has it.
    """
    shape = tuple(cg.node(ns.node).meta["val"].shape)
    if spec.ndim != len(shape) or not spec.divides(shape, mesh.shape):
        raise ValueError(f"spec {spec} for {what} does not divide its shape {shape} on mesh {mesh.shape}")
    restrict(ns, lambda s: s.out_spec == spec)


def on_mesh(spec: ShardingSpec, mesh_shape: tuple[int, int]) -> ShardingSpec:
    """``spec`` without the mesh axes of size 1 (a split along one device is no split): a spec
    written for the cluster (``S01R``) on a stage's ``1 x 2`` logical mesh is ``S1R``."""
    return ShardingSpec(tuple(tuple(a for a in entry if mesh_shape[a] > 1) for entry in spec.dims))


def check_names(cg, options: PlanOptions) -> dict[str, str]:
    """Check that every name ``options`` forces a spec on exists in the captured graph ``cg``.

    Returns:
        every parameter / buffer FQN (tied names included) -> its placeholder.

    Raises:
        ValueError: a ``param_specs`` key that names no parameter or buffer, an ``input_specs`` key
            that names no input (the message lists the inputs).
    """
    by_fqn = {fqn: ph for ph, fqn in {**cg.param_fqns, **cg.buffer_fqns}.items()}
    for ph, fqn in {**cg.param_fqns, **cg.buffer_fqns}.items():
        for alias in cg.tied.get(fqn, []):
            by_fqn[alias] = ph
    for fqn in options.param_specs:
        if fqn not in by_fqn:
            raise ValueError(f"param_specs names {fqn!r}, which is not a parameter (or buffer) of the model")
    for key in options.input_specs:
        if key.isdigit() and int(key) >= len(cg.input_names):
            raise ValueError(f"input_specs names input {key}; the model takes {len(cg.input_names)} tensors "
                             f"({', '.join(cg.input_names)})")
        if not key.isdigit() and key not in cg.input_names:
            raise ValueError(f"input_specs names {key!r}, which is not an input of the model "
                             f"({', '.join(cg.input_names)})")
    return by_fqn


def apply_constraints(cg, table: dict[str, NodeStrategies], mesh, options: PlanOptions) -> None:
    """Force ``options`` on ``table``: the strategies of the whole graph (the intra-op pass) or of
    one pipeline stage's nodes (the inter-op pass), on ``mesh``.

    - ``param_specs``: each named parameter (or frozen parameter, or buffer; a tied weight by any
      of its names) keeps only strategies storing it in that spec, read on ``mesh`` (``on_mesh``);
    - ``input_specs``: the same for user inputs, by name or position;
    - ``force_data_parallel``: every other parameter replicated (its optimizer states too, as DDP,
      unless ``zero_stage`` is given), the batch dim of every value split over all mesh axes of
      more than one device; ``replicate_params``: only the former;
    - ``batch_axis``: the batch dim of every value split along that axis (nothing on an axis of
      size 1);
    - ``zero_stage``: every trainable parameter in that ZeRO stage over ``data_parallel_axes``
      (stage 3: its storage split along all of them; under ``force_data_parallel`` along those
      only).
    - ``allow_replicated_heavy_ops`` False: a compute-heavy op (``ops.HEAVY_TARGETS``) keeps the
      strategies that split its work (a result or contraction label) along every mesh axis of more
      than one device, when it has any.
    Parameters and inputs not in ``table`` (another stage's) are skipped.

    Raises:
        ValueError: a name the model does not have, a spec that does not divide its tensor, a batch
            that does not divide over the forced axes, a parameter that cannot take the forced
            ZeRO stage.
    """
    by_fqn = check_names(cg, options)
    forced = {by_fqn[fqn] for fqn in options.param_specs}
    for fqn, text in options.param_specs.items():
        if by_fqn[fqn] in table:
            force(table[by_fqn[fqn]], on_mesh(ShardingSpec.parse(text), mesh.shape), f"parameter {fqn}", cg, mesh)
    for key, text in options.input_specs.items():
        name = cg.input_names[int(key)] if key.isdigit() else key
        if name in table:
            force(table[name], on_mesh(ShardingSpec.parse(text), mesh.shape), f"input {name}", cg, mesh)
    if not options.allow_replicated_heavy_ops:
        axes = {a for a in (0, 1) if mesh.shape[a] > 1}
        for name, ns in table.items():
            if cg.node(name).target in HEAVY_TARGETS:
                split = [s for s in ns.strategies
                         if axes <= set(s.partial_axes).union(*(o.axes() | set(o.partial) for o in s.out_specs))]
                ns.strategies[:] = split or ns.strategies
    dp_axes = data_parallel_axes(options, mesh.shape)
    if options.force_data_parallel or options.replicate_params:  # except those given a spec (ZeRO, Megatron)
        allowed = set(dp_axes) if options.zero_stage == 3 else set()
        for ph in cg.param_fqns:
            if ph in table and ph not in forced:
                restrict(table[ph], lambda s: s.out_spec.axes() <= allowed and (options.zero_stage or not s.zero_stage))
    _split_batch(cg, table, mesh, options)
    if options.zero_stage is not None and dp_axes:  # after the batch splits: its fallback reads the uses' strategies
        _force_zero_stage(cg, table, options.zero_stage, dp_axes)


def _split_batch(cg, table: dict[str, NodeStrategies], mesh, options: PlanOptions) -> None:
    """Keep the strategies splitting the batch dim of every value (not of parameters) as
    ``force_data_parallel`` or ``batch_axis`` asks (``apply_constraints``).

    Raises:
        ValueError: an input's batch dim does not divide over those axes, or its forced spec does
            not split it there.
    """
    axis = options.batch_axis
    if options.force_data_parallel:
        want = tuple(a for a in (0, 1) if mesh.shape[a] > 1)
        keep = lambda entry: entry == want  # noqa: E731
    elif axis is not None and mesh.shape[axis] > 1:
        want = (axis,)
        keep = lambda entry: axis in entry  # noqa: E731
    else:
        return
    for name, ns in table.items():
        d = ns.batch_dims[0]
        if d is None or name in cg.param_fqns:
            continue
        ok = [s for s in ns.strategies if keep(s.out_spec.dims[d])]
        if ok:
            ns.strategies[:] = ok
        elif name in cg.input_names:
            shape = tuple(cg.node(name).meta["val"].shape)
            index = str(cg.input_names.index(name))
            given = options.input_specs.get(name, options.input_specs.get(index))
            if given is not None:  # the forced spec, not the size, leaves no strategy
                raise ValueError(f"input_specs gives input {name} (shape {shape}) the spec {given}, which does not "
                                 f"split its batch dim {d} along mesh axes {list(want)} as "
                                 f"{'force_data_parallel' if options.force_data_parallel else 'batch_axis'} asks: "
                                 "split that dim there too, or drop one of the two")
            n = math.prod(mesh.shape[a] for a in want)
            raise ValueError(f"batch dim {d} of input {index} ({name}, shape {shape}) does not divide over mesh "
                             f"axes {list(want)} of mesh {mesh.shape}, {n} devices: give a batch that is a "
                             f"multiple of {n}")


def data_parallel_axes(options: PlanOptions, mesh_shape: tuple[int, int]) -> tuple[int, ...]:
    """The mesh axes (of more than one device) ``options`` split the batch over: all of them
    under ``force_data_parallel``, else ``batch_axis``'s; ``()`` when neither is given."""
    axes = (0, 1) if options.force_data_parallel else () if options.batch_axis is None else (options.batch_axis,)
    return tuple(a for a in axes if mesh_shape[a] > 1)


def _force_zero_stage(cg, table: dict[str, NodeStrategies], stage: int, axes: tuple[int, ...]) -> None:
    """Keep the strategies of ZeRO ``stage`` over ``axes`` of every trainable parameter in ``table``.

    ZeRO-3 stores a parameter split along a dim over ``axes``; one that no dim of splits evenly
    there (a 0-dim temperature, odd sizes) takes ZeRO-2 over them instead (its gradient and
    optimizer states in flat slices, which need no dim: DeepSpeed's flat partitions hold any
    parameter), as ``Plan.zero_stages`` then says; and where ZeRO-2 cannot hold it either (an op
    such as CLIP's ``logit_scale.exp()`` takes its gradient complete: ``complete_gradient_uses``)
    it stays replicated over ``axes``, as DeepSpeed's ZeRO-3 keeps small parameters whole."""
    zero2 = lambda s: s.zero_stage == 2 and s.zero_axes == axes  # noqa: E731
    if stage == 3:
        keep = lambda s: not s.zero_stage and set(axes) <= s.out_spec.axes()  # noqa: E731
    else:
        keep = lambda s: s.zero_stage == stage and s.zero_axes == axes  # noqa: E731
    complete = {ph for ph, _ in complete_gradient_uses(cg, table, axes)} if stage == 3 else set()
    for ph, fqn in cg.param_fqns.items():
        if not cg.node(ph).users:  # no op reads it: no gradient, no optimizer state to partition
            continue
        if stage == 3 and ph in table and not any(keep(s) for s in table[ph].strategies) and any(
                zero2(s) for s in table[ph].strategies):
            restrict(table[ph], (lambda s: not s.zero_stage) if ph in complete else zero2)
            continue
        if ph in table and not any(keep(s) for s in table[ph].strategies):
            shape = tuple(cg.node(ph).meta["val"].shape)
            raise ValueError(f"zero_stage={stage}: parameter {fqn} (shape {shape}) has no strategy partitioned over "
                             f"mesh axes {list(axes)} (a forced spec splits them, a dim does not divide, or the "
                             f"plan is pipelined and several layers use it: ZeRO-1/2 are offered to a parameter one "
                             "layer uses); drop zero_stage or its forced spec")
        if ph in table:
            restrict(table[ph], keep)


def zero_stage_blockers(cg, table: dict[str, NodeStrategies], mesh, options: PlanOptions) -> list[str]:
    """Why ``options.zero_stage`` 1 or 2 leaves the ILP no choice, one line per parameter use: a
    ZeRO-1/2 parameter's gradient must reach it as a partial sum over exactly its zero axes (its
    reduce-scatter or all-reduce then runs once per step, ``ReshardCosts``), but an op such as
    ``w.t()``, ``w.pow(2)`` or ``scale.exp()`` between the parameter and the batch-split op
    receives a complete gradient (the all-reduce runs at its own output). Empty when nothing
    blocks (or no ZeRO-1/2 stage is asked for)."""
    axes = data_parallel_axes(options, mesh.shape)
    if options.zero_stage not in (1, 2) or not axes:
        return []
    readers: dict[str, list[str]] = {}
    for ph, name in complete_gradient_uses(cg, table, axes):
        readers.setdefault(name, []).append(cg.param_fqns[ph])
    return [f"parameter {fqns[0]} is read by {name} ({cg.node(name).target}), which takes its gradient complete, "
            f"not partial over mesh axes {list(axes)}" if len(fqns) == 1 else
            f"parameters {' and '.join(fqns)} are read by {name} ({cg.node(name).target}), which cannot leave "
            f"all their gradients partial over mesh axes {list(axes)} at once" for name, fqns in readers.items()]


def complete_gradient_uses(cg, table: dict[str, NodeStrategies], axes: tuple[int, ...]) -> list[tuple[str, str]]:
    """``(parameter placeholder, node)`` of every use of a trainable parameter in ``table`` where no
    strategy of the node leaves the gradients of all its trainable parameter operands partial over
    exactly ``axes`` at once: such parameters cannot all take ZeRO-1/2 over ``axes``
    (``zero_stage_blockers``). Jointly, not one operand at a time: an outer product of two
    parameters, ``einsum("i,j->ij", u, v)``, leaves ``u``'s gradient partial only where ``v`` is
    split and ``v``'s only where ``u`` is, never both (sweep 10: that ILP was infeasible under
    ``zero_stage=2`` with a bare "no assignment satisfies" message naming no op)."""
    casts = cg.param_casts  # a cast passes the gradient through: its readers are its parameter's uses
    out = []
    for name, ns in table.items():
        if name in casts:
            continue
        params = [(i, casts.get(src, src)) for i, src in enumerate(ns.inputs)]
        params = [(i, ph) for i, ph in params if ph in cg.param_fqns and ph in table]
        if params and not any(all(len(s.grad_partial) > i and s.grad_partial[i] is not None
                                  and tuple(sorted(s.grad_partial[i])) == axes for i, _ in params)
                              for s in ns.strategies):
            out += [(ph, name) for ph in dict.fromkeys(ph for _, ph in params)]
    return out
