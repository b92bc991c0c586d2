"""aten op schemas: arguments by name, in-place writes, randomness.

Every op rule (``compiler/ops.py``) and every local variant (``runtime/executor.py``) reads an
op's arguments through ``bind_args``, never by position: export writes arguments only up to the
last non-default one, so a position means different arguments in different calls
(``cross_entropy_loss``'s ``reduction`` is position 3, ``label_smoothing`` 5).
"""
from __future__ import annotations

import torch
import torch.fx


ALIAS_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
"""Ops whose result shares its operand's storage unchanged: a write into the result is a write
into the operand."""


_aten = torch.ops.aten
TRANSPOSED_CONV_OPS = {_aten.conv_transpose1d.default, _aten.conv_transpose2d.input, _aten.conv_transpose3d.input}
"""Transposed convolutions: weight ``(in, out / groups, *kernel)``."""
CONV_OPS = {_aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default, _aten.conv1d.padding,
            _aten.conv2d.padding, _aten.conv3d.padding, _aten.convolution.default} | TRANSPOSED_CONV_OPS
"""Convolutions: ``(input, weight, bias, ..., groups)`` by schema name (``.padding``: a string
padding such as ``"same"``; ``convolution`` says ``transposed`` itself)."""


def is_transposed_conv(target, args: dict) -> bool:
    """Whether a convolution (``CONV_OPS``, its arguments ``args`` by name) is transposed."""
    return target in TRANSPOSED_CONV_OPS or bool(args.get("transposed"))


def alias_root(value):
    """The value ``value`` aliases: followed back through ``ALIAS_OPS`` (a write into ``value``
    is a write into it)."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target in ALIAS_OPS:
        value = value.args[0]
    return value


def bind_args(target, args: tuple, kwargs: dict) -> dict[str, object]:
    """The arguments of a call of the aten op ``target`` by their schema names, in schema order,
    with the schema's defaults for those not given (positional or keyword alike).

    Every rule and local variant reads arguments through this, never by position: an optional
    argument moves when an earlier one is left out (``cross_entropy_loss``'s ``reduction`` is
    position 3, ``label_smoothing`` 5), and export writes only up to the last non-default one.

    Raises:
        TypeError: ``target`` has no schema (not an aten op overload).
    """
    schema = getattr(target, "_schema", None)
    if schema is None:
        raise TypeError(f"{target} has no schema: its arguments cannot be read by name")
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def op_args(node: torch.fx.Node) -> dict[str, object]:
    """``bind_args`` of a graph node (operands stay ``torch.fx.Node``)."""
    return bind_args(node.target, node.args, node.kwargs)


def with_arg(target, args: tuple, kwargs: dict, name: str, value) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of ``target`` with argument ``name`` set to ``value``, where
    the call passes it (positionally or by keyword; keyword when it passes neither)."""
    names = [a.name for a in target._schema.arguments]
    i = names.index(name)
    if i < len(args):
        return args[:i] + (value,) + args[i + 1:], kwargs
    return args, {**kwargs, name: value}


def written_args(target) -> list[str]:
    """Names of the arguments an aten op writes in place (``Tensor(a!)`` in its schema)."""
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] if schema else []


_STATS_WRITES = {torch.ops.aten.instance_norm.default: "use_input_stats", torch.ops.aten.batch_norm.default: "training"}
"""Ops that update their ``running_mean`` / ``running_var`` arguments in place though their schema
does not mark them written (``Tensor?``, not ``Tensor(a!)?``), and the flag under which they do."""


def stats_written(node: torch.fx.Node) -> list[str]:
    """The running-statistics arguments ``node`` updates in place without its schema saying so
    (``_STATS_WRITES``): ``instance_norm(track_running_stats=True)`` in training keeps its composite
    op in the captured graph (batch norm is functionalized), and ``written_args`` missed the write:
    a recomputed layer ran it again in backward (sweep 10: ``remat="all"`` died "one of the
    variables needed for gradient computation has been modified by an inplace operation")."""
    flag = _STATS_WRITES.get(node.target)
    if flag is None:
        return []
    a = op_args(node)
    return [s for s in ("running_mean", "running_var") if a[flag] and isinstance(a[s], torch.fx.Node)]


def is_random(target) -> bool:
    """Whether the op draws from the RNG (dropout, bernoulli, rand_like, attention dropout ...)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
