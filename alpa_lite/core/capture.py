"""Capture a training loss as an aten-level torch.fx graph with global shapes.

``torch.export`` (non-strict) of ``loss = loss_fn(model(*inputs, **kwargs), *targets)`` gives a
functional graph whose placeholders are the parameters, buffers, lifted tensor constants and
user inputs (the pytree leaves of the call), and whose node metadata carries FakeTensor values
(shape, dtype). Models built on the meta device capture without allocating weights, so a
39B-parameter model plans on a laptop.

Export records some constructs as higher-order ops on subgraphs; capture rewrites them into
plain aten ops or refuses them, so that every later pass sees one flat graph:
- a ``torch.no_grad()`` region (``wrap_with_set_grad_enabled``) is inlined with its operands
  detached, ``enable_grad`` regions inlined as they are;
- an autocast region (``wrap_with_autocast``) is retraced under autocast and inlined (the casts
  autocast inserts become ``_to_copy`` ops);
- reentrant ``torch.utils.checkpoint`` is captured as its function (checkpointing changes
  memory, not gradients; export would otherwise record it as a no-grad region);
- every other higher-order op (``torch.cond``, ``while_loop``, ...) raises ``CaptureError``.
In-place writes of buffers, and in-place writes through a view of another tensor
(``h[..., :8] *= 0.5``), are functionalized (``run_decompositions({})``): a plan may run a view on
a resharded copy, which a write would never carry back to the base.
A frozen parameter (``requires_grad=False``) is state, not a trainable parameter: it is listed
with the buffers, so it gets no gradient, no gradient sync and no optimizer state.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import operator
import pickle
import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from unittest import mock

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, TensorArgument
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from .aten import ALIAS_OPS, op_args, written_args


class CaptureError(RuntimeError):
    """The model (or loss) could not be captured; the message names the construct or op."""


@dataclass
class CapturedGraph:
    """A captured training loss.

    Attributes:
        graph_module: the exported ``torch.fx.GraphModule`` (aten ops, FakeTensor ``meta["val"]``).
        param_fqns: placeholder name -> FQN of a trainable parameter in the user's model (tied
            weights share one).
        buffer_fqns: placeholder name -> FQN of a buffer (non-persistent ones included) or of a
            frozen parameter (``requires_grad=False``).
        input_names: placeholder names of the user inputs then targets: the pytree leaves of
            ``((*inputs, *targets), kwargs)``, in that order.
        loss_name: the node holding the scalar loss.
        tied: parameter FQN -> other FQNs of the same tensor (weight tying).
        buffer_mutations: output node name -> FQN of the buffer it updates (batch-norm statistics).
        param_mutations: node name -> placeholder of the parameter whose new value it computes (an
            in-place update of a parameter that export functionalized, e.g. ``max_norm``'s
            ``embedding_renorm``): the runtime writes it into the stored parameter when the node
            runs, and the node's other consumers read the parameter itself, as in eager mode.
        requires_grad: names of the nodes whose value autograd tracks (depends on a parameter).
        constants: placeholder name -> lifted tensor constant (a tensor literal in ``forward``).
        in_spec: pytree structure of the call ``((*inputs, *targets), kwargs)``.
        static_inputs: leaf position -> value of a non-tensor leaf of the call (an int, a flag):
            the graph is specialized on it, so a step must pass the same value.
    """

    graph_module: torch.fx.GraphModule
    param_fqns: dict[str, str]
    buffer_fqns: dict[str, str]
    input_names: list[str]
    loss_name: str
    tied: dict[str, list[str]] = field(default_factory=dict)
    buffer_mutations: dict[str, str] = field(default_factory=dict)
    param_mutations: dict[str, str] = field(default_factory=dict)
    requires_grad: set[str] = field(default_factory=set)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    in_spec: pytree.TreeSpec | None = None
    static_inputs: dict[int, object] = field(default_factory=dict)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def node(self, name: str) -> torch.fx.Node:
        return self._by_name[name]

    def __post_init__(self):
        self._by_name = {n.name: n for n in self.graph.nodes}

    def flat_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensor leaves of a call ``(*inputs, *targets, **kwargs)``, one per ``input_names``
        entry (the non-tensor leaves are checked against ``static_inputs`` and dropped).

        Raises:
            ValueError: the call's structure (number of tensors, dict keys, nesting) is not the
                captured one, or a non-tensor leaf has another value; the message gives both.
        """
        order = self.in_spec.child(1).context if self.in_spec is not None else []
        if set(kwargs) == set(order):
            kwargs = {k: kwargs[k] for k in order}
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if self.in_spec is not None and spec != self.in_spec:
            raise ValueError(f"the batch has structure {_describe(spec)}; the model was captured with "
                             f"{_describe(self.in_spec)} (inputs then targets, then keyword inputs)")
        for i, value in self.static_inputs.items():
            if leaves[i] != value:
                raise ValueError(f"non-tensor input {i} of the flattened batch is {leaves[i]!r}; the graph was "
                                 f"captured (and specialized) with {value!r}")
        return [x for i, x in enumerate(leaves) if i not in self.static_inputs]

    @functools.cached_property
    def param_casts(self) -> dict[str, str]:
        """Node name -> parameter placeholder, for every dtype cast (``_to_copy``) of a trainable
        parameter (mixed precision's low-precision copy: its uses are the parameter's uses).
        Read once per instance (the graph is final once captured; ``stage_view`` makes another):
        the cost graphs ask it per node."""
        return {n.name: n.args[0].name for n in self.graph.nodes
                if n.target in _CASTS and getattr(n.args[0], "name", None) in self.param_fqns}

    def fingerprint(self) -> str:
        """Hash of the graph's ops and shapes; a plan records it to detect another model."""
        h = hashlib.sha256()
        for n in self.graph.nodes:
            h.update(f"{n.name}|{n.op}|{n.target}|{tuple(shape_of(n) or ())}\n".encode())
        return h.hexdigest()[:16]

    @property
    def param_lookups(self) -> dict[str, str]:
        """Node name -> parameter placeholder, for every row lookup (``aten.embedding`` of the
        weight, ``aten.index.Tensor`` of it) that is the only reader of a trainable parameter (or
        of its one low-precision cast, ``param_casts``, the parameter's only reader).
        Its backward is linear in its output's gradient (``embedding_dense_backward`` /
        ``index_put`` with accumulation), so a partial sum of that gradient gives a partial sum of
        the weight's: the gradient can be synchronized on the weight, in a bucket
        (``compiler.training_step.defer_gradient_sync``), instead of on the lookup's output."""
        out = {}
        for ph in self.param_fqns:
            weight = self.node(ph)
            users = list(weight.users)
            if len(users) == 1 and users[0].target in _CASTS:
                weight, users = users[0], list(users[0].users)
            if len(users) == 1 and users[0].target in _LOOKUPS and users[0].args[0] is weight:
                out[users[0].name] = ph
        return out


_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)
_LOOKUPS = (torch.ops.aten.embedding.default, torch.ops.aten.index.Tensor)


def shape_of(node: torch.fx.Node) -> tuple[int, ...] | None:
    """Global shape of a single-tensor node, None for non-tensors and tuples."""
    val = node.meta.get("val")
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def nbytes_of(val) -> int:
    """Bytes of a tensor (or of every tensor in a tuple) of ``meta["val"]``."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes_of(v) for v in val)
    return 0


def batch_size(tree) -> int:
    """Dim 0 of the first tensor leaf of ``tree`` (inputs, targets, keyword inputs).

    Raises:
        ValueError: no tensor with a dim 0 in ``tree``.
    """
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise ValueError("the inputs hold no tensor with a batch dim")


def rows(tree, start: int, stop: int):
    """``tree`` with every tensor leaf of a dim 0 cut to rows ``[start, stop)`` (a microbatch)."""
    return pytree.tree_map(lambda x: x[start:stop] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, tree)


_LAYOUT_OPS = {"view", "_unsafe_view", "reshape", "expand", "squeeze", "unsqueeze", "clone", "contiguous",
               "alias", "detach", "permute", "transpose", "t", "flatten", "unflatten", "_assert_tensor_metadata"}
"""Ops that only change a tensor's shape or layout: a microbatch of one row may capture with one
more or fewer (an ``expand`` of a size-1 dim export leaves out, a ``view`` it adds)."""


def _compute_ops(cg: CapturedGraph) -> list[tuple[str, str]]:
    """``(node name, op)`` of each call of ``cg``'s graph that computes (not ``_LAYOUT_OPS``), in order."""
    out = []
    for n in cg.graph.nodes:
        if n.op != "call_function":
            continue
        packet = getattr(n.target, "overloadpacket", None)
        if getattr(packet, "__name__", None) in _LAYOUT_OPS:
            continue
        out.append((n.name, str(n.target)))
    return out


def batch_specialization(whole: CapturedGraph, part: CapturedGraph, whole_rows: int, part_rows: int) -> str | None:
    """Why the graph of a microbatch of ``part_rows`` rows computes something else than the
    graph of the whole batch of ``whole_rows`` rows, or None when their ops (layout ops aside)
    are the same, in the same order. Export runs Python: code that branches on the batch size
    (``if x.shape[0] >= 8``, a loop over the rows) records only the branch of the size it saw,
    so each microbatch would run its own branch, and their gradients are not the whole batch's
    (a pipeline's microbatches, gradient accumulation: ``UserWarning`` naming it). Constants
    computed from the size (``h * x.shape[0]``) are not compared: the divisor of a mean differs
    too, and rightly (``compiler/loss_reduction.py``)."""
    a, b = _compute_ops(whole), _compute_ops(part)
    if [t for _, t in a] == [t for _, t in b]:
        return None
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x[1] != y[1]), min(len(a), len(b)))
    at = (f"the whole batch's graph runs {a[i][1]} ({a[i][0]})" if i < len(a) else "the whole batch's graph ends") + \
        (f" where the microbatch's runs {b[i][1]} ({b[i][0]})" if i < len(b) else " where the microbatch's ends")
    return (f"the graph captured for a microbatch of {part_rows} rows is not the graph of the whole batch of "
            f"{whole_rows} rows ({len(a)} and {len(b)} ops; first difference: {at}): the model branches on the "
            f"batch size (Python control flow on x.shape[0]), so each microbatch runs another computation than the "
            f"whole batch")


def check_microbatch_rows(inputs: tuple, targets: tuple, kwargs: dict | None, what: str) -> None:
    """Microbatches (a pipeline's, gradient accumulation's) cut dim 0 of every tensor leaf with a
    dim (``rows``) and pass a 0-dim one whole: refuse a leaf whose dim 0 is not the batch's
    (``batch_size``), such as class weights or one ``(T, T)`` mask for the whole batch given as
    an input, which would be cut into pieces that no longer fit the model (an error from deep
    inside the capture of the microbatch). One whose dim 0 equals the batch's by chance passes
    here and is cut; ``api._microbatch_capture`` names the cut when the microbatch's capture fails.

    Raises:
        ValueError: naming the leaf (``input 2``, ``target 0``, ``keyword input 'mask'``, with its
            path inside a nested one), its shape and the batch, and ``what`` cuts it.
    """
    batch = batch_size((inputs, targets, kwargs or {}))
    for top, tree in (("input", inputs), ("target", targets), ("keyword input", kwargs or {})):
        for path, x in pytree.tree_flatten_with_path(tuple(tree) if top != "keyword input" else dict(tree))[0]:
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] != batch:
                head, rest = path[0], pytree.keystr(path[1:])
                name = f"{top} {head.key!r}" if top == "keyword input" else f"{top} {head.idx}"
                raise ValueError(f"{what} cut dim 0 of every tensor input into microbatches, but {name}{rest} has shape "
                                 f"{tuple(x.shape)}, not a dim 0 of the batch ({batch}): give a tensor shared by the "
                                 "whole batch (class weights, one mask for every sample) to the model as a buffer "
                                 "or attribute, or expand it to the batch")


def _describe(spec: pytree.TreeSpec) -> str:
    """``spec`` written as the call it flattens: ``(T, {'a': T}), {'labels': T}``."""
    if spec.is_leaf():
        return "T"
    kids = [_describe(c) for c in spec.children()]
    if spec.type is dict:
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(spec.context, kids)) + "}"
    if spec.type in (tuple, list):
        return ("(%s)" if spec.type is tuple else "[%s]") % ", ".join(kids)
    return f"{getattr(spec.type, '__name__', spec.type)}({', '.join(kids)})"


class TrainingLoss(torch.nn.Module):
    """``forward(*inputs, *targets, **kwargs) -> scalar loss`` around the user's model and loss_fn
    (``kwargs`` go to the model).

    With ``compute_dtype`` (mixed precision, as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``
    and Micikevicius et al. 2018, "Mixed Precision Training", section 3.1): the model runs on its
    floating parameters and floating inputs cast to ``compute_dtype`` (the casts are ``_to_copy``
    ops of the graph reading the fp32 parameter placeholders, so gradients reach the fp32 master
    parameters), every op computes in the dtype of its operands, and the model's floating outputs
    are cast to fp32 before ``loss_fn`` (a loss the model returns itself is cast after it).
    Targets and buffers keep their dtypes, and so do the parameters of batch norms (as FSDP's
    ``MixedPrecision`` leaves ``_BatchNorm`` modules, and as autocast runs them): torch's batch
    norm takes a low-precision input with fp32 weights and running statistics, not with weights
    of the input's dtype ("expected scalar type BFloat16 but found Float")."""

    def __init__(self, model: torch.nn.Module, loss_fn, num_inputs: int, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        self.compute_dtype = compute_dtype

    def forward(self, *args, **kwargs):
        inputs, targets = args[: self.num_inputs], args[self.num_inputs:]
        if self.compute_dtype is None:
            out = self.model(*inputs, **kwargs)
        else:
            low = lambda x: _cast_floating(x, self.compute_dtype)  # noqa: E731
            norms = {f"{m}.{n}" if m else n for m, mod in self.model.named_modules()
                     if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) for n, _ in mod.named_parameters(recurse=False)}
            params = {name: p if name in norms else low(p) for name, p in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, params, pytree.tree_map(low, inputs),
                                             pytree.tree_map(low, kwargs))
            out = pytree.tree_map(lambda x: _cast_floating(x, torch.float32), out)
        if self.loss_fn is not None:
            return self.loss_fn(out, *targets)
        if isinstance(out, dict) or hasattr(out, "loss"):
            out = out["loss"] if isinstance(out, dict) else out.loss
        return out if self.compute_dtype is None else _cast_floating(out, torch.float32)


def _cast_floating(x, dtype: torch.dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _check_loss_fn_arity(loss_fn, targets: tuple) -> None:
    """Raise CaptureError, saying what to pass, when ``loss_fn(output, *targets)`` cannot bind."""
    if loss_fn is None:
        return
    try:
        inspect.signature(loss_fn).bind(None, *targets)
    except ValueError:  # no signature to read (some builtins): export reports any mismatch
        return
    except TypeError as e:
        raise CaptureError(
            f"loss_fn is called as loss_fn(output, *targets) with {len(targets)} target(s), which it cannot take "
            f"({e}); pass the example targets with global shapes as targets=(y, ...) to plan() / parallelize(), "
            "and give the same targets after the inputs to trainer.step(*inputs, *targets)") from None


def _check_model_call(model: torch.nn.Module, inputs: tuple, kwargs: dict) -> None:
    """Raise CaptureError, naming the argument and where to give it, when ``model(*inputs,
    **kwargs)`` cannot bind to ``model.forward`` (a missing keyword-only input, a misspelled key)."""
    if model._forward_pre_hooks:  # a hook may supply or rewrite arguments: export reports any mismatch
        return
    try:
        inspect.signature(model.forward).bind(*inputs, **kwargs)
    except ValueError:  # no signature to read
        return
    except TypeError as e:
        raise CaptureError(
            f"{type(model).__name__}.forward cannot be called with the {len(inputs)} example input(s) and keyword "
            f"input(s) {sorted(kwargs)}: {e}; give positional inputs as example_inputs and keyword inputs (keyword-only "
            "ones included) as example_kwargs={name: tensor} to plan() / parallelize(), and the same keywords to "
            "trainer.step(*inputs, **kwargs)") from None


def capture(model: torch.nn.Module, example_inputs: tuple, loss_fn=None, targets: tuple = (),
            example_kwargs: dict | None = None, compute_dtype: torch.dtype | None = None) -> CapturedGraph:
    """Capture ``loss_fn(model(*example_inputs, **example_kwargs), *targets)`` (or the model's own
    scalar loss).

    Args:
        model: the module; parameters may live on the meta device.
        example_inputs: model inputs with GLOBAL shapes (real, meta or fake tensors; nested
            tuples, lists and dicts of them too).
        loss_fn: ``loss_fn(output, *targets) -> scalar``; None when the model returns its loss
            (a scalar tensor, or an output with ``.loss`` such as HuggingFace models with labels).
        targets: extra tensors passed to ``loss_fn``.
        example_kwargs: keyword inputs of the model (``input_ids=``, ``labels=`` ...).
        compute_dtype: mixed precision: the model computes in this dtype on fp32 parameters
            (``TrainingLoss``); None: as it is.

    Raises:
        CaptureError: ``loss_fn`` cannot take ``(output, *targets)`` (the message says to pass
            ``targets=``), ``model.forward`` cannot take the example inputs and keywords (a missing
            keyword-only input: the message names it and says to pass ``example_kwargs=``), torch.export failed (the message names the construct or op), the graph
            holds a construct the runtime cannot run (a higher-order op such as ``torch.cond``,
            a custom object, an effectful op), or the captured value is not a scalar loss.
    """
    return _capture(model, example_inputs, loss_fn, targets, example_kwargs, compute_dtype, any_batch=False)[0]


def _capture(model, example_inputs, loss_fn, targets, example_kwargs, compute_dtype,
             any_batch: bool) -> tuple[CapturedGraph, set[str], tuple[int, float]]:
    """``capture``, or with ``any_batch`` its graph for every batch size (``capture_any_batch``):
    (the graph, with its size nodes when ``any_batch``; the placeholders whose dim 0 is the batch;
    the batch sizes the graph holds for, inclusive)."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    _check_loss_fn_arity(loss_fn, tuple(targets))
    _check_model_call(model, tuple(example_inputs), dict(example_kwargs or {}))
    check_backward_hooks(model)
    args = tuple(example_inputs) + tuple(targets)
    kwargs = dict(example_kwargs or {})
    wrapper = TrainingLoss(model, loss_fn, len(example_inputs), compute_dtype)
    batch = batch_size((args, kwargs)) if any_batch else 0

    def export(stack_traces: bool) -> torch.export.ExportedProgram:
        # each node's stack trace costs a traceback while tracing (~0.2 s of GPT-3 2.6B's 1.5 s);
        # only the refusal of a construct reads it (``_where``). Export's intermediate graph
        # modules write their code only when run (lazy graph modules): it wrote GPT-3 2.6B's
        # whole graph as Python five times, ~0.15 s
        with _python_state_kept(model), _reentrant_checkpoint_as_function(), _refuse_untraced(), \
                _use_lazy_graph_module(True), \
                mock.patch.object(torch.fx.config, "do_not_emit_stack_traces", not stack_traces):
            return _export_any_batch(wrapper, args, kwargs, batch) if any_batch else _export(wrapper, args, kwargs)

    ep = export(stack_traces=False)
    if any_batch and any(_hop_name(n.target) == "wrap_with_autocast" for n in ep.graph.nodes):
        raise CaptureError("an autocast region is retraced at the example's shapes (make_fx): its graph is not "
                           "for any batch size")
    try:
        _inline_regions(ep.graph_module)
    except CaptureError:  # its message names the model's line: export again, with the stack traces
        _inline_regions(export(stack_traces=True).graph_module)
        raise
    batched, batches = _concrete_batch(ep, batch) if any_batch else (set(), (0, 0))
    _name_outputs(ep)
    if compute_dtype is not None:
        _refuse_written_casts(ep)
        _cast_per_use(ep.graph_module)
    frozen = {n for n, p in wrapper.named_parameters(remove_duplicate=False) if not p.requires_grad}
    trainable = {spec.arg.name for spec in ep.graph_signature.input_specs
                 if spec.kind is InputKind.PARAMETER and spec.target not in frozen}
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    try:
        tracked, mutated = _fake_run(ep.graph, trainable, store=any_batch)
    except (DynamicOutputShapeException, DataDependentOutputException) as e:  # export let it through
        why = (f"; {_value_read()}" if "_local_scalar_dense" in str(e) else
               ": a result whose shape depends on the values (x[mask], nonzero, unique, masked_select): alpa-lite "
               "plans fixed shapes; use torch.where, masked_fill or a multiplied mask")
        raise CaptureError(f"cannot capture {type(wrapper.model).__name__}: {_first_line(e)}{why}") from e
    except RuntimeError:  # a parameter written in place (a leaf that requires grad): look for writes without grad
        tracked, mutated = None, _fake_run(ep.graph, set(), store=any_batch)[1]
    through_view = _write_through_view(ep.graph)
    if (mutated or through_view) and any_batch:
        raise CaptureError(f"the model writes {'buffers' if mutated else 'through a view'} in place: functionalizing "
                           "retraces the graph at the example's shapes, so it is not for any batch size")
    if mutated or through_view:  # export's training IR writes buffers / views in place: functionalize
        ep = _functionalized(ep, mutated, through_view)
        tracked = None  # another graph: its tracked nodes are found below
    gm = ep.graph_module
    _drop_layout_copies(gm)
    _name_outputs(ep)
    sig = ep.graph_signature
    if sig.user_inputs_to_mutate:
        raise CaptureError(f"the model writes its input {next(iter(sig.user_inputs_to_mutate.values()))} in place; "
                           "alpa-lite feeds inputs as shards, so an in-place update of an input is not supported")
    strip = lambda fqn: fqn[len("model."):] if fqn.startswith("model.") else fqn  # noqa: E731
    param_fqns, buffer_fqns, constants, input_names, static = {}, {}, {}, [], {}
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind is InputKind.PARAMETER:
            (buffer_fqns if spec.target in frozen else param_fqns)[name] = strip(spec.target)
        elif spec.kind is InputKind.BUFFER:
            buffer_fqns[name] = strip(spec.target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            constants[name] = ep.constants[spec.target]
        elif spec.kind is InputKind.USER_INPUT:
            leaf = len(input_names) + len(static)
            if isinstance(spec.arg, TensorArgument):
                input_names.append(name)
            else:  # an int / float / bool / str leaf: export specialized the graph on its value
                static[leaf] = spec.arg.value
                _bake(gm, name, spec.arg.value)
        elif spec.kind is InputKind.CUSTOM_OBJ:
            raise CaptureError(f"custom object {spec.target} (a TorchScript class) is not supported")
        else:
            raise CaptureError(f"effectful op {_effectful_op(gm)} (it threads an effect token) is not supported")
    outputs = list(sig.user_outputs)
    if len(outputs) != 1:
        raise CaptureError(f"the loss must be one scalar tensor, the model returned {len(outputs)} outputs: return the "
                           "loss alone or a dict with a 'loss' entry, or pass loss_fn= to pick it (loss_fn=lambda "
                           "out: out[0] for a (loss, logits) tuple)")
    loss = next(n for n in gm.graph.nodes if n.name == outputs[0])
    shape = shape_of(loss)
    if shape is None or len(shape) != 0:
        raise CaptureError(f"the captured output has shape {shape}, not a scalar loss; pass loss_fn=")
    unsupported = [n for n in gm.graph.nodes if n.op == "call_function" and not _is_op(n.target)
                   and not (any_batch and _is_size(n))]
    if unsupported:
        raise CaptureError(f"unsupported construct in the graph: {unsupported[0].target}")
    tied = _one_placeholder_per_tensor(gm, model, param_fqns, buffer_fqns)
    mutations = {k: strip(v) for k, v in sig.buffers_to_mutate.items()}
    placeholder_of = {name: ph for ph, fqn in {**param_fqns, **buffer_fqns}.items()
                      for name in (fqn, *tied.get(fqn, ()))}
    param_mutations = _parameters_read_in_place(gm, sig.parameters_to_mutate, placeholder_of, strip)
    if tracked is None:
        tracked = _fake_run(gm.graph, set(param_fqns))[0]
    else:  # the graph the fake run saw, less the layout copies dropped since (their users are tracked alike) and
        # the placeholders of tied names, which feed nothing now
        tracked = {n.name for n in gm.graph.nodes if n.name in tracked and (n.op != "placeholder" or n.name in param_fqns)}
    gm.recompile()  # the code of the final graph, written once (the passes above edit the graph only)
    return (CapturedGraph(gm, param_fqns, buffer_fqns, input_names, loss.name, tied, mutations, param_mutations,
                          tracked, constants, ep.call_spec.in_spec, static), batched, batches)


def _export(wrapper: TrainingLoss, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict) of ``wrapper(*args, **kwargs)`` at the example's shapes.

    Raises:
        CaptureError: export failed, also after ``symbolic_trace`` (the message names the construct or op).
    """
    try:
        return torch.export.export(wrapper, args, kwargs, strict=False)
    except CaptureError:  # a construct refused while exporting (_refuse_untraced)
        raise
    except Exception as first:  # noqa: BLE001 - reported with its construct below
        try:  # plain modules: symbolic_trace's python-level graph sometimes exports when the module does not
            traced = torch.fx.symbolic_trace(wrapper)
            return torch.export.export(traced, args, kwargs, strict=False)
        except Exception:  # noqa: BLE001
            hint = _data_dependent_hint(first) or _model_line(first) + _low_dtype_hint(wrapper, first)
            raise CaptureError(f"cannot capture {type(wrapper.model).__name__}: {_first_line(first)}{hint}") from first


def _model_line(e: BaseException) -> str:
    """`` (at FILE:LINE: code)``: the innermost frame of ``e``'s traceback in the model's code
    (outside torch and alpa-lite), or ''. Sweep 12: an FNO under ``mixed_precision="bf16"`` died
    "cannot capture Spectral: RuntimeError: Unsupported dtype BFloat16", naming no op or line."""
    import traceback
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent.parent))
    user = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)
            and not f.filename.startswith("<")]
    return f" (at {user[-1].filename}:{user[-1].lineno}: {user[-1].line})" if user else ""


def _low_dtype_hint(wrapper: TrainingLoss, e: BaseException) -> str:
    """What to do when an op does not run in the mixed-precision compute dtype, or ''."""
    dtype = wrapper.compute_dtype
    if dtype is None or str(dtype).removeprefix("torch.").replace("bfloat16", "BFloat16").replace(
            "float16", "Half") not in str(e):
        return ""
    return (f"; mixed_precision casts the model's floating inputs and weights to {str(dtype).removeprefix('torch.')}, "
            "and this op does not run in it (torch.fft does not take bfloat16): compute it in float32 "
            "(x.float() before it, the result cast back with .to(x.dtype))")


def _data_dependent_hint(e: BaseException) -> str:
    """What to do about export's ``GuardOnDataDependentSymNode`` (a Python number or branch taken
    from a tensor's values, which one graph for every step cannot hold), with the model's line
    export names; '' for another error."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if not isinstance(e, GuardOnDataDependentSymNode):
        return ""
    call = re.search(r"The following call raised this error:\s*\n\s*(File [^\n]+)\n\s*([^\n]+)", str(e))
    where = f" at {call.group(1)}: {call.group(2).strip()}" if call else ""
    return f"; {_value_read(where)}"


def _value_read(where: str = "") -> str:
    """Why a tensor's value read into Python is refused (``where``: the model's line). Export either
    refuses it (a guard on it, ``_data_dependent_hint``) or lets a bare ``t.item()`` through as
    ``aten._local_scalar_dense``, which alpa-lite's shape propagation then cannot run (sweep 10: it
    was named "a result whose shape depends on the values (x[mask], nonzero ...)")."""
    return (f"a Python number or branch taken from a tensor's values (float(t), int(t), t.item(), 'if t > 0:'){where}. "
            "alpa-lite captures one graph for every step, so such a value cannot change from step to step: compute "
            "with tensors instead (nn.BatchNorm with momentum=None reads its num_batches_tracked this way: give it "
            "a momentum)")


def _export_any_batch(wrapper: TrainingLoss, args: tuple, kwargs: dict, batch: int) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict) of ``wrapper(*args, **kwargs)`` with dim 0 of every tensor
    leaf of a dim one symbol, the batch (``torch.export.Dim``).

    Raises:
        CaptureError: a tensor input's dim 0 is not ``batch``, ``batch`` is 1 (export specializes a
            size 1), or export failed: the model specializes on the batch size (a literal batch in
            a ``view``, a branch on it: export refuses a guard on a ``Dim``), or fails anyway.
    """
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if batch < 2 or any(x.shape[0] != batch for x in leaves):
        raise CaptureError(f"the tensor inputs' dims 0 are {[x.shape[0] for x in leaves]}: not one batch of at least 2")
    dim = torch.export.Dim("batch")
    spec = lambda x: {0: dim} if isinstance(x, torch.Tensor) and x.dim() > 0 else None  # noqa: E731
    dynamic = {"args": pytree.tree_map(spec, args)} | ({"kwargs": pytree.tree_map(spec, kwargs)} if kwargs else {})
    try:
        return torch.export.export(wrapper, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except CaptureError:  # a construct refused while exporting (_refuse_untraced)
        raise
    except Exception as e:  # noqa: BLE001 - the reason the graph is not batch-free
        raise CaptureError(f"{type(wrapper.model).__name__} does not export for any batch size: {_first_line(e)}") from e


def _concrete_batch(ep: torch.export.ExportedProgram, batch: int) -> tuple[set[str], tuple[int, float]]:
    """Give every placeholder of ``ep`` its value at ``batch`` (a fake tensor; the ops stay symbolic):
    (the placeholders whose dim 0 is the batch, the (smallest, largest) batch export's range
    allows, at least 2: a size 1 is specialized by export).

    Raises:
        CaptureError: a dim other than the inputs' dim 0 is symbolic.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode, batched, batches = FakeTensorMode(), set(), (2, float("inf"))
    for n in ep.graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if not isinstance(val, torch.Tensor):
            continue
        symbolic = [d for d, s in enumerate(val.shape) if not isinstance(s, int)]
        if not symbolic:
            continue
        if symbolic != [0]:
            raise CaptureError(f"placeholder {n.name} has symbolic dims {symbolic}, not only the batch (dim 0)")
        r = ep.range_constraints[val.shape[0].node.expr]
        batches = (max(batches[0], int(r.lower)), min(batches[1], float(r.upper)))
        batched.add(n.name)
        with mode:
            n.meta["val"] = torch.empty((batch, *val.shape[1:]), dtype=val.dtype, device=val.device,
                                        requires_grad=val.requires_grad)
    return batched, batches


def _is_size(node: torch.fx.Node) -> bool:
    """A node computing a size (``aten.sym_size``, arithmetic on sizes) of a graph for any batch."""
    val = node.meta.get("val")
    return isinstance(val, int) and not isinstance(val, bool)


def _replace_sizes(graph: torch.fx.Graph) -> None:
    """Replace every size node (``_is_size``) by its value in the ops that read it, as a capture at
    the example's shapes records them (``view(x, [8, 1024, 768])``)."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and _is_size(node):
            for user in list(node.users):
                user.replace_input_with(node, node.meta["val"])
            graph.erase_node(node)


@dataclass(frozen=True)
class _Ref:
    """A node read by another node, by name (``AnyBatchGraph.nodes``)."""
    name: str


_KEPT_META = ("nn_module_stack", "stack_trace", "torch_fn")  # besides "val": what the planner and errors read


def _target_key(target):
    """An op as ``(namespace, name, overload)``, which pickles; any other target as it is."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target._opname, target._overloadname
    return target


def _target_of(key):
    if isinstance(key, tuple):
        return getattr(getattr(getattr(torch.ops, key[0]), key[1]), key[2])
    return key


def _val_key(val):
    """``meta["val"]`` as (shape, dtype, device) per tensor, for comparing two graphs."""
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.dtype, val.device
    if isinstance(val, (tuple, list)):
        return tuple(_val_key(v) for v in val)
    return val


_FIELDS = tuple(f.name for f in fields(CapturedGraph) if f.name != "graph_module")


def _summary(cg: CapturedGraph) -> tuple:
    """Everything of ``cg`` the planner and runtime read: each node's name, op, target, arguments,
    kept metadata and value (shape, dtype, device), and the other fields (constants by value)."""
    nodes = [(n.name, n.op, _target_key(n.target), torch.fx.node.map_arg((n.args, n.kwargs), lambda a: _Ref(a.name)),
              [n.meta.get(k) for k in _KEPT_META], _val_key(n.meta.get("val"))) for n in cg.graph.nodes]
    other = {f: getattr(cg, f) for f in _FIELDS if f != "constants"}
    return nodes, other, {k: (_val_key(v), v.tolist()) for k, v in cg.constants.items()}


@dataclass
class AnyBatchGraph:
    """A captured training loss for every batch size in ``batches`` (``capture_any_batch``), as
    picklable records: a plan cache keeps it (``compiler/plan_cache.py``) and ``at(batch)`` gives
    the ``CapturedGraph`` of that batch without torch.export and without running the graph.

    Attributes:
        nodes: one record per graph node, in order: ``(name, op, target, args, kwargs, meta)``; a
            node read is a ``_Ref``, an op target ``(namespace, name, overload)``; ``meta["val"]``
            is the node's value with every size an expression in the batch (``_Sized``): tensors
            as ``_SizedTensor``, sizes as ``_Sized``. Size nodes (``aten.sym_size`` and arithmetic
            on sizes) are kept: ``at`` replaces them.
        fields: the ``CapturedGraph`` fields besides the graph (node names: the same at any batch;
            ``in_spec`` as ``pytree.treespec_dumps`` writes it).
        batches: the (smallest, largest) batch it holds for (export's range, at least 2).
    """

    nodes: list[tuple]
    fields: dict
    batches: tuple[int, float]

    @classmethod
    def of(cls, cg: CapturedGraph, batched: set[str], batches: tuple[int, float]) -> AnyBatchGraph:
        """The records of ``cg`` (valued at some batch; ``batched``: the placeholders whose dim 0
        is the batch), each value's sizes found by one fake run of the graph with the batch a
        symbol (a ``ShapeEnv``'s, as torch.export's dynamic dims).

        Raises:
            CaptureError: the run fails or specializes the batch (an op guards on its value), or a
                size depends on data (an unbacked symbol).
        """
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
        hint = next((cg.node(n).meta["val"].shape[0] for n in batched), 2)
        source = ConstantSource("batch")
        symbol = env.create_symbol(hint, source, DimDynamic.DYNAMIC)
        batch = env.create_symintnode(symbol, hint=hint, source=source)
        records = []
        for n in cg.graph.nodes:
            meta = {k: n.meta[k] for k in _KEPT_META if k in n.meta}
            if "val" in n.meta:
                meta["val"] = n.meta["val"]
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: _Ref(a.name))
            records.append((n.name, n.op, _target_key(n.target), tuple(args), dict(kwargs), meta))
        graph = cls(records, {}, batches)._graph(lambda val: val)
        for n in graph.nodes:
            val = n.meta.get("val")
            if n.op == "placeholder" and isinstance(val, torch.Tensor):
                with mode:
                    n.meta["val"] = torch.empty([batch if d == 0 and n.name in batched else s
                                                 for d, s in enumerate(val.shape)], dtype=val.dtype, device=val.device)
        try:
            _fake_run(graph, set(cg.param_fqns), store=True, mode=mode)
        except Exception as e:  # noqa: BLE001 - an op that needs a concrete batch: the reason kept
            raise CaptureError(f"the graph does not run with a symbolic batch: {_first_line(e)}") from e
        if env.replacements.get(symbol, symbol) != symbol:
            raise CaptureError(f"an op specializes the batch to {env.replacements[symbol]}: the graph is not for "
                               "any batch size")
        for record, n in zip(records, graph.nodes):
            if "val" in record[5]:
                record[5]["val"] = _sized(n.meta["val"], symbol)
        try:  # a tree spec pickles with a deprecation warning on load: kept as its JSON
            in_spec = pytree.treespec_dumps(cg.in_spec)
        except (TypeError, NotImplementedError) as e:  # an input container without a serialized name
            raise CaptureError(f"the inputs' structure cannot be kept: {e}") from e
        return cls(records, {f: getattr(cg, f) for f in _FIELDS} | {"in_spec": in_spec}, batches)

    def _graph(self, value) -> torch.fx.Graph:
        """The records as a graph, each node's ``meta["val"]`` ``value(its recorded val)``."""
        graph, env = torch.fx.Graph(), {}
        read = lambda a: env[a.name] if isinstance(a, _Ref) else a  # noqa: E731
        for name, op, target, args, kwargs, meta in self.nodes:
            node = graph.create_node(op, _target_of(target), torch.fx.node.map_aggregate(args, read),
                                     torch.fx.node.map_aggregate(kwargs, read), name=name)
            node.meta = dict(meta)
            if "val" in meta:
                node.meta["val"] = value(meta["val"])
            env[name] = node
        return graph

    def at(self, batch: int) -> CapturedGraph:
        """The graph at ``batch`` samples, node for node the graph ``capture`` gives for inputs of
        that batch: every value a fake tensor of its sizes at ``batch``, every size node replaced
        by its value.

        Raises:
            ValueError: ``batch`` outside ``batches``.
        """
        from torch._subclasses.fake_tensor import FakeTensorMode

        if not self.batches[0] <= batch <= self.batches[1]:
            raise ValueError(f"batch {batch} is outside the batch sizes {self.batches} this graph holds for")
        sizes: dict = {}
        with FakeTensorMode():
            graph = self._graph(lambda val: _at_batch(val, batch, sizes))
        _replace_sizes(graph)
        return CapturedGraph(torch.fx.GraphModule(torch.nn.Module(), graph), **self.fields | {"in_spec": pytree.treespec_loads(self.fields["in_spec"])})


@dataclass(frozen=True)
class _Sized:
    """A size (``kind`` int, float or bool) as a sympy expression in the batch ``symbol``."""

    kind: type
    expr: object
    symbol: object

    def at(self, batch: int, memo: dict):
        key = (self.expr, batch)
        if key not in memo:
            memo[key] = self.kind(self.expr.xreplace({self.symbol: batch}))
        return memo[key]


@dataclass(frozen=True)
class _SizedTensor:
    """A tensor value: its shape (ints and ``_Sized``), dtype, device and ``requires_grad``."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def _sized(val, symbol):
    """``val`` (a value of the symbolic fake run of ``AnyBatchGraph.of``) with its sizes as ``_Sized``."""
    def size(s):
        if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = s.node.expr
            if expr.free_symbols - {symbol}:
                raise CaptureError(f"a size depends on data ({expr}): the graph is not for any batch size")
            kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(s)]
            return kind(expr) if expr.is_number else _Sized(kind, expr, symbol)
        return s

    if isinstance(val, torch.Tensor):
        return _SizedTensor(tuple(size(s) for s in val.shape), val.dtype, val.device, val.requires_grad)
    if isinstance(val, (tuple, list)):
        return type(val)(_sized(v, symbol) for v in val)
    return size(val)


def _at_batch(val, batch: int, memo: dict):
    """``_sized(val)`` at ``batch``: tensors as fake tensors (in the active ``FakeTensorMode``)."""
    if isinstance(val, _Sized):
        return val.at(batch, memo)
    if isinstance(val, _SizedTensor):
        shape = [s.at(batch, memo) if isinstance(s, _Sized) else s for s in val.shape]
        return torch.empty(shape, dtype=val.dtype, device=val.device, requires_grad=val.requires_grad)
    if isinstance(val, (tuple, list)):
        return type(val)(_at_batch(v, batch, memo) for v in val)
    return val


def capture_any_batch(model: torch.nn.Module, example_inputs: tuple, loss_fn=None, targets: tuple = (),
                      example_kwargs: dict | None = None, compute_dtype: torch.dtype | None = None, *,
                      fresh: CapturedGraph) -> AnyBatchGraph:
    """The graph of ``capture(model, example_inputs, ...)`` for every batch size: export with
    dim 0 of every tensor input a symbol (``torch.export.Dim``), the same processing as
    ``capture`` on values at the example's batch, the size nodes kept (docs/planner.md,
    "Re-planning a changed batch").

    Args: as ``capture``; ``fresh``: what ``capture`` gave for this call: the result at the
        example's batch must be it, node for node (names, ops, arguments, metadata, shapes).

    Raises:
        CaptureError: the model specializes on the batch (export refuses the symbol: a literal
            batch in a ``view``, a branch on the batch size), a tensor input's dim 0 is not the
            batch or the batch is 1, the graph is retraced at the example's shapes (an autocast
            region, in-place buffer updates), or the result at the example's batch is not ``fresh``.
    """
    cg, batched, batches = _capture(model, example_inputs, loss_fn, targets, example_kwargs, compute_dtype,
                                       any_batch=True)
    graph = AnyBatchGraph.of(cg, batched, batches)
    if _summary(graph.at(batch_size(((example_inputs, targets), example_kwargs)))) != _summary(fresh):
        raise CaptureError("the graph for any batch size, at the example's batch, is not the graph captured at it")
    return graph


_MODULE_STATE = set(vars(torch.nn.Module()))  # what every module holds (parameters, hooks ...): keyed apart


def capture_key(model: torch.nn.Module, example_inputs: tuple, loss_fn=None, targets: tuple = (),
                example_kwargs: dict | None = None, compute_dtype: torch.dtype | None = None) -> tuple | None:
    """What the graph ``capture_any_batch`` gives for this call depends on, besides the batch
    size: the torch version; the source files of the model's module classes and of ``loss_fn``
    (outside torch) and of this module; each module's name, class, training flag, hook counts and
    other attributes (their ``repr``: a config, a head count); each parameter's and buffer's name, shape, dtype, device, ``requires_grad`` and which names
    share a tensor; the call's structure with each tensor's shape past dim 0, dtype and device,
    and every non-tensor value; ``loss_fn`` (pickled), ``compute_dtype``, grad mode and the
    default dtype. A plan cache keeps the graph under it (``compiler/plan_cache.py``). Code a
    ``forward`` calls in other files is not in it: after editing such code, use a new cache.

    Returns None when ``loss_fn`` cannot be pickled (a lambda, a local function): no key.
    """
    try:
        loss = pickle.dumps(loss_fn, protocol=4)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    leaves, spec = pytree.tree_flatten((inputs, tuple(targets), dict(example_kwargs or {})))
    call = [(tuple(x.shape[1:]), x.dim(), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else ("value", x)
            for x in leaves]
    modules = [(name, f"{type(m).__module__}.{type(m).__qualname__}", m.training, len(m._forward_hooks),
                len(m._forward_pre_hooks), sorted((k, repr(v)) for k, v in vars(m).items() if k not in _MODULE_STATE))
               for name, m in model.named_modules(remove_duplicate=False)]
    first: dict[int, int] = {}
    tensors = [(name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad, first.setdefault(id(t), i))
               for i, (name, t) in enumerate([*model.named_parameters(remove_duplicate=False),
                                              *model.named_buffers(remove_duplicate=False)])]
    torch_dir = str(Path(torch.__file__).parent)
    files = {inspect.getsourcefile(type(m)) for m in model.modules()} | {__file__}
    if loss_fn is not None:
        try:
            files.add(inspect.getsourcefile(loss_fn if inspect.isfunction(loss_fn) else type(loss_fn)))
        except TypeError:  # a builtin: its behaviour is torch's
            pass
    read = sorted(f for f in files if f and not f.startswith(torch_dir) and Path(f).is_file())
    sources = hashlib.sha256(b"".join(Path(f).read_bytes() for f in read)).hexdigest()
    return (torch.__version__, sources, modules, tensors, str(spec), call, loss, str(compute_dtype),
            torch.is_grad_enabled(), torch.get_default_dtype())


def _cast_per_use(gm: torch.fx.GraphModule) -> None:
    """Mixed precision's casts of placeholders (parameters, inputs), which ``TrainingLoss`` makes
    before the model runs: one cast per use, placed right before it and in its module, so the
    graph is the fp32 graph with a cast on each use (layer clustering and repeated-layer sharing
    see the same layers; a parameter used by two pipeline stages is cast in each). Export's
    ``_assert_tensor_metadata`` checks of the placeholders go (nothing reads them)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and node.args[0].op == "placeholder":
            graph.erase_node(node)
        elif node.target in _CASTS and node.args[0].op == "placeholder":
            for user in list(node.users):
                with graph.inserting_before(user):
                    cast = graph.node_copy(node)
                cast.meta = {**node.meta, "nn_module_stack": user.meta.get("nn_module_stack"),
                             "stack_trace": user.meta.get("stack_trace")}
                user.replace_input_with(node, cast)
            graph.erase_node(node)
    graph.lint()


def _refuse_written_casts(ep: torch.export.ExportedProgram) -> None:
    """Mixed precision: refuse a parameter's low-precision copy that the model writes in place.

    ``TrainingLoss`` runs the model on bf16 / fp16 copies of the weights; an ``Embedding(max_norm=)``
    renormalizes its copy in place, a weight pruned under ``torch.no_grad()`` is its copy pruned.
    The graph gives each reader its own cast (``_cast_per_use``), so the write reached none of them
    (``max_norm`` under bf16 data parallelism: gradients 534 x their bound off, silently).

    Raises:
        CaptureError: naming the parameter and what to do.
    """
    for node in ep.graph.nodes:
        if node.target in _CASTS and node.args[0].op == "placeholder" and _written_in_place(node):
            name = _state_name(ep, node.args[0].name)
            raise CaptureError(f"mixed precision: the model writes its low-precision copy of {name} in place "
                               "(Embedding(max_norm=), a weight pruned in forward): not supported; train it without "
                               "mixed_precision, or apply the write to the weight outside the training step")


def _state_name(ep: torch.export.ExportedProgram, placeholder: str) -> str:
    """The model's name of the parameter or buffer behind ``placeholder`` (the placeholder's
    name where it is neither)."""
    names = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs if spec.target}
    return names.get(placeholder, placeholder).removeprefix("model.")


def _written_in_place(node: torch.fx.Node) -> bool:
    """Whether an op writes ``node``'s value in place, itself or through a view of it."""
    for user in node.users:
        if not isinstance(user.target, torch._ops.OpOverload):
            continue
        if any(op_args(user)[a] is node for a in written_args(user.target)) or \
                (user.target.is_view and _written_in_place(user)):
            return True
    return False


def _one_placeholder_per_tensor(gm: torch.fx.GraphModule, model: torch.nn.Module, param_fqns: dict[str, str],
                                buffer_fqns: dict[str, str]) -> dict[str, list[str]]:
    """Weight tying: export lifts one placeholder per name of a tensor used under several names
    (GPT's ``wte.weight`` and ``lm_head.weight``) and feeds every use through one of them. Keep that
    one (the most used), move any other use to it, and drop the others from ``param_fqns`` /
    ``buffer_fqns`` (edited in place), so a tied weight is one parameter: one shard, one
    gradient, one optimizer state. Returns the kept FQN -> the tensor's other names."""
    names: dict[int, list[str]] = {}
    for fqn, p in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(p), []).append(fqn)
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    tied = {}
    for group in (g for g in names.values() if len(g) > 1):
        for table in (param_fqns, buffer_fqns):
            held = [ph for ph, fqn in table.items() if fqn in group]
            if not held:
                continue
            keep = max(held, key=lambda ph: len(nodes[ph].users))
            for ph in held:
                if ph != keep:
                    nodes[ph].replace_all_uses_with(nodes[keep])
                    del table[ph]
            tied[table[keep]] = [fqn for fqn in group if fqn != table[keep]]
    return tied


def _parameters_read_in_place(gm: torch.fx.GraphModule, mutated: dict[str, str], placeholder_of: dict[str, str],
                              strip) -> dict[str, str]:
    """Undo functionalization's renaming of an in-place parameter update: the consumers of the
    new value read the parameter again (so gradients flow to it, as in eager mode, where the op
    wrote the parameter's storage through a ``detach``). Returns node -> parameter placeholder."""
    out = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for node_name, target in mutated.items():
        node, ph = nodes[node_name], nodes[placeholder_of[strip(target)]]
        node.replace_all_uses_with(ph, delete_user_cb=lambda user: user.op != "output")
        out[node_name] = ph.name
    return out


def _bake(gm: torch.fx.GraphModule, placeholder: str, value) -> None:
    """Replace a non-tensor input placeholder by its (specialized) value."""
    node = next(n for n in gm.graph.nodes if n.name == placeholder)
    for user in list(node.users):
        user.replace_input_with(node, value)
    gm.graph.erase_node(node)


def check_backward_hooks(model: torch.nn.Module) -> None:
    """Refuse gradient hooks on ``model`` that the captured graph would never run: a module's
    backward hook (``register_backward_hook``, ``register_full_backward_hook``, their pre hooks,
    and the global ones of ``torch.nn.modules.module``), a parameter's ``register_hook`` and its
    ``register_post_accumulate_grad_hook`` (sweep 12: an optimizer step in backward, or a
    gradient scaled after accumulation, was dropped silently by the trainer and by verify's
    reference alike, since ``copy.deepcopy`` drops it too). The training step differentiates the captured graph on
    its own tensors (sweep 11: ``fc1.register_backward_hook`` halving its gradients trained
    silently off one process, fc1's gradients 1e4 times their bound; a parameter's hook, which
    ``copy.deepcopy`` drops, was lost by the trainer and by verify's reference alike).

    Raises:
        CaptureError: naming the first module or parameter with such a hook.
    """
    for name, mod in model.named_modules():
        if mod._backward_hooks or mod._backward_pre_hooks:
            raise CaptureError(f"module {name or '(the model)'} ({type(mod).__name__}) has a backward hook: the captured "
                               "graph has no hooks, so it would never run; remove it, or write what it does to the "
                               "gradient into forward with detach (a gradient scaled by s: s * x + (1 - s) * x.detach())")
    from torch.nn.modules import module as _module
    if _module._global_backward_hooks or _module._global_backward_pre_hooks:
        raise CaptureError("a global module backward hook (torch.nn.modules.module.register_module_full_backward_hook "
                           "/ register_module_full_backward_pre_hook): the captured graph has no hooks, so it would "
                           "never run; remove it before alpa-lite captures the model")
    for name, p in model.named_parameters():
        if p._backward_hooks:
            raise CaptureError(f"parameter {name} has a gradient hook (register_hook): the trainer computes the gradients "
                               "of its own shards, so it would never run; remove it (to clip gradients, pass "
                               "max_grad_norm=)")
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise CaptureError(f"parameter {name} has a post-accumulate-grad hook (register_post_accumulate_grad_hook, "
                               "as an optimizer step in backward): the trainer trains its own shards of the parameters "
                               "and steps its own optimizer after the gradient sync, so the hook would never run; "
                               "remove it and pass the optimizer to alpa-lite (optimizer=)")


@contextmanager
def _python_state_kept(model: torch.nn.Module):
    """Warn when the model's forward changes a Python number, bool or string attribute of one of
    its modules (``self.calls += 1``), and put the value back: the step runs the graph captured
    from one call, so forward's Python code never runs again, and a value it reads (a warmup scale
    from a step counter) is the one it had at capture, every step (sweep 11: a counter-driven
    warmup trained silently off one process, loss 6.4e-2 off at step 3, bound 1.1e-4). Keep such
    state in a buffer, updated under ``torch.no_grad()``, which the step carries."""
    kinds = (int, float, bool, str)
    before = {(name, k): v for name, mod in model.named_modules() for k, v in vars(mod).items() if type(v) in kinds}
    changed = {}

    def compare(*_):  # after forward, inside the trace: export puts attributes back itself when it ends
        for name, mod in model.named_modules():
            for k, v in vars(mod).items():
                was = before.get((name, k), v)
                if type(v) in kinds and v is not was and v != was:  # (a tensor stored here is export's to judge)
                    changed[f"{name + '.' if name else ''}{k}"] = f"{before[name, k]!r} -> {v!r}"
                    setattr(mod, k, before[name, k])

    handle = model.register_forward_hook(compare)
    try:
        yield
    finally:
        handle.remove()
        if changed:
            changed = [f"{k} ({v})" for k, v in changed.items()]
            warnings.warn(f"forward changed Python attribute(s) {', '.join(changed)}; alpa-lite runs the graph captured "
                          "from one call, so forward does not run again and reads their values at capture every step "
                          "(put back now). Keep state that forward reads in a buffer, written under torch.no_grad()",
                          stacklevel=4)


@contextmanager
def _refuse_untraced():
    """Refuse, while exporting, what export does not record or cannot trace. ``t.data`` read or
    written by the model's code (export died with "We found a fake tensor in the exported program
    constant's list", and ``self.ema.data = ...`` captured without the write: the buffer never
    changed). And what would change gradients outside the ops export records: a
    gradient taken in forward (``torch.autograd.grad``: export died with "We found a fake tensor in
    the exported program constant's list"), a gradient hook registered in forward (``t.register_hook(fn)``; a module's full backward hook,
    which runs through an autograd Function of torch's) and a custom ``torch.autograd.Function``
    with its own ``backward`` (gradient reversal, a straight-through estimator). Export records
    the ops of the Function's ``forward`` and no hooks, and the training step differentiates the
    graph, so the hook never ran and the Function's backward was replaced by the derivative of its
    forward (sweep 11: DANN's gradient reversal and a 0.5x gradient hook trained silently off one
    process, gradients 1e4 times their bound). torch's own Functions (reentrant checkpointing,
    made a plain call by ``_reentrant_checkpoint_as_function``) pass; so does a
    ``torch.library.custom_op`` with ``register_autograd``, one op of the graph whose registered
    backward autograd runs (gradient reversal so trains equal to one process under data
    parallel, Megatron, a pipeline and compiled)."""
    from torch.nn.modules._functions import BackwardHookFunction
    apply = torch.autograd.Function.__dict__["apply"].__func__

    def refusing_apply(cls, *args, **kwargs):
        if cls is BackwardHookFunction:
            raise CaptureError("a module's full backward hook (register_full_backward_hook / "
                               "register_full_backward_pre_hook): the captured graph has no hooks, so it would never "
                               "run; remove the hook, or write what it does to the gradient into forward")
        if not cls.__module__.startswith("torch."):
            raise CaptureError(
                f"custom autograd.Function {cls.__module__}.{cls.__qualname__}: export records the ops of its "
                "forward, and the training step would differentiate those instead of running its backward. Make it "
                "a torch.library.custom_op with register_autograd (captured as one op, its backward kept), or write "
                "its gradient into forward with detach (a straight-through estimator: x + (f(x) - x).detach(); "
                "gradient reversal by lam: (1 + lam) * x.detach() - lam * x)")
        return apply(cls, *args, **kwargs)

    def refusing_grad(*args, **kwargs):
        raise CaptureError("a gradient taken in forward (torch.autograd.grad, torch.func.grad: a gradient penalty, "
                           "WGAN-GP's or R1's): alpa-lite captures one graph for one backward and cannot capture a "
                           "gradient inside it")

    def refusing_hook(tensor, hook):
        raise CaptureError("t.register_hook(fn) in forward: the captured graph has no hooks, so fn would never run; "
                           "write it into forward with detach (a gradient scaled by s: s * x + (1 - s) * x.detach())")

    def refusing_post_hook(tensor, hook):
        raise CaptureError("t.register_post_accumulate_grad_hook(fn) in forward: the captured graph has no hooks, so "
                           "fn would never run; remove it (pass the optimizer to alpa-lite, optimizer=)")

    data = torch._C.TensorBase.data
    torch_dir = str(Path(torch.__file__).parent)

    def refuse_data(tensor):
        if sys._getframe(2).f_code.co_filename.startswith(torch_dir):
            return False  # torch's own code
        raise CaptureError("t.data in forward: export cannot trace it, and a write through it (self.ema.data = ..., "
                           "w.data.clamp_()) is not recorded; read with t.detach(), write buffers or weights under "
                           "torch.no_grad() (self.ema.mul_(0.9).add_(0.1 * m), w.clamp_(-c, c))")

    def get_data(tensor):
        return refuse_data(tensor) or data.__get__(tensor)

    def set_data(tensor, value):
        refuse_data(tensor) or data.__set__(tensor, value)

    with mock.patch.object(torch.autograd.Function, "apply", classmethod(refusing_apply)), \
            mock.patch.object(torch.Tensor, "data", property(get_data, set_data)), \
            mock.patch.object(torch.Tensor, "register_hook", refusing_hook), \
            mock.patch.object(torch.Tensor, "register_post_accumulate_grad_hook", refusing_post_hook), \
            mock.patch.object(torch.autograd, "grad", refusing_grad):
        yield


@contextmanager
def _reentrant_checkpoint_as_function():
    """Run ``torch.utils.checkpoint(..., use_reentrant=True)`` as its plain function while
    exporting: the reentrant variant runs the function under ``no_grad`` and recomputes it in
    its own backward, which export would record as a region without gradients. As in eager
    mode, the function gets no gradients when none of its tensor arguments requires grad."""
    from torch.utils.checkpoint import CheckpointFunction

    def apply(function, preserve_rng_state, *args):
        tracked = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        with torch.set_grad_enabled(tracked and torch.is_grad_enabled()):
            return function(*args)

    with mock.patch.object(CheckpointFunction, "apply", staticmethod(apply)):
        yield


def _effectful_op(gm: torch.fx.GraphModule) -> str:
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and _hop_name(n.target) == "with_effects"), None)
    return str(node.args[1]) if node is not None else "(unknown)"


def _hop_name(target) -> str | None:
    return target.name() if isinstance(target, torch._ops.HigherOrderOperator) else None


def _where(node: torch.fx.Node) -> str:
    """`` at FILE:LINE: code``: the innermost frame of ``node``'s stack trace outside torch, or ''."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip()]
    frames = [(f, c) for f, c in zip(lines, lines[1:] + [""]) if f.startswith("File ")]
    torch_dir = str(Path(torch.__file__).parent)
    user = [(f, c) for f, c in frames if torch_dir not in f and __file__ not in f and "<eval_with_key>" not in f]
    return f" ({user[-1][0]}: {user[-1][1]})" if user else ""


_REFUSED = {
    "cond": "torch.cond (data-dependent control flow)",
    "while_loop": "torch.while_loop (data-dependent control flow)",
    "map_impl": "torch.map (a loop over a subgraph)",
    "scan": "scan (a loop over a subgraph)",
    "associative_scan": "associative_scan (a loop over a subgraph)",
    "with_effects": "an effectful op (threads an effect token)",
    "auto_functionalized": "a custom op that mutates its inputs",
    "auto_functionalized_v2": "a custom op that mutates its inputs",
    "flex_attention": "flex_attention (a score_mod subgraph)",
}


def _inline_regions(gm: torch.fx.GraphModule) -> None:
    """Replace ``no_grad`` / ``enable_grad`` and autocast regions by their ops (module docstring),
    until no higher-order op is left; refuse any other higher-order op, naming it.

    Raises:
        CaptureError: a higher-order op that cannot be inlined (``torch.cond`` ...).
    """
    while True:
        node = next((n for n in gm.graph.nodes if n.op == "call_function" and _hop_name(n.target)), None)
        if node is None:
            break
        name = _hop_name(node.target)
        if name == "wrap_with_set_grad_enabled":
            enabled, sub, *operands = node.args
            _inline(gm, node, getattr(gm, sub.target).graph, operands, detach=not enabled)
        elif name == "wrap_with_autocast":
            device, dtype, enabled, cache, sub, *operands = node.args
            body = _under_autocast(getattr(gm, sub.target), operands, device, dtype, enabled, cache)
            _inline(gm, node, body, operands, detach=False)
        else:
            what = _REFUSED.get(name, f"the higher-order op {name}")
            raise CaptureError(f"{what} is not supported{_where(node)}; alpa-lite plans one flat graph of "
                               "aten ops (rewrite the construct with tensor ops, e.g. torch.where)")
        if sub.op == "get_attr" and not sub.users:
            gm.graph.erase_node(sub)
    gm.graph.lint()


def _drop_layout_copies(gm: torch.fx.GraphModule) -> None:
    """Remove ``aten.contiguous`` nodes (each use reads the operand itself), so the graph does not
    depend on the device it was captured on: export keeps a ``.contiguous()`` only where the
    operand's strides (the device's kernels: SDPA's output layout differs on meta and CPU) make
    it copy. The value is the same either way; a ``view`` that needed the copy runs as ``reshape``
    (the runtime executor, ``_fake_run``)."""
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten.contiguous.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _functionalized(ep: torch.export.ExportedProgram, mutated: set[str], through_view: str | None
                    ) -> torch.export.ExportedProgram:
    """``ep`` functionalized (``run_decompositions({})``, which keeps the ops: each write of a
    parameter or buffer becomes an output, ``buffers_to_mutate`` / ``parameters_to_mutate``; a
    write through a view a ``*_scatter``), its ``aten.copy`` made differentiable.

    Raises:
        CaptureError: torch could not functionalize it (a tied weight written in place, an
            ``Embedding(max_norm=)`` sharing its weight with the output layer, fails inside
            torch's AOT export with an ``AssertionError``); the message names what is written.
    """
    written = ", ".join(sorted(_state_name(ep, n) for n in mutated)) or f"a view ({through_view})"
    ep.graph_module.recompile()  # it runs the module's code: written for the graph the passes above edited
    try:
        ep = ep.run_decompositions({})
    except Exception as e:  # noqa: BLE001 - torch's own assertion, deep in AOT export
        raise CaptureError(f"the model writes {written} in place in forward and torch could not functionalize the "
                           f"write ({_first_line(e)}); a tied weight written in place (Embedding(max_norm=) sharing "
                           "its weight with the output layer) is one such case: untie it or drop the in-place "
                           "write") from e
    _differentiable_copies(ep.graph_module)
    return ep


def _differentiable_copies(gm: torch.fx.GraphModule) -> None:
    """Replace functionalization's ``aten.copy(self, src)`` (the value a ``copy_`` wrote: ``src``
    broadcast to ``self``'s shape, in its dtype) by ``src`` itself, ``expand`` ed and cast where
    needed: autograd has no derivative for ``aten.copy`` ("derivative for aten::copy is not
    implemented"), and ``h[..., :8] = g`` writes one."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.target is not aten.copy.default:
            continue
        a = op_args(node)
        dst, value = a["self"].meta["val"], a["src"]
        with gm.graph.inserting_before(node):
            if tuple(value.meta["val"].shape) != tuple(dst.shape):
                value = gm.graph.call_function(aten.expand.default, (value, list(dst.shape)))
                value.meta["val"] = value.args[0].meta["val"].expand(dst.shape)
            if value.meta["val"].dtype != dst.dtype:
                value = gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": dst.dtype})
                value.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)


def _name_outputs(ep: torch.export.ExportedProgram) -> None:
    """Point the signature's outputs (the loss, buffer updates) at the graph's output values
    again: an inlined region's results replace the ``getitem`` nodes that the signature named."""
    out = next(n for n in reversed(ep.graph.nodes) if n.op == "output")
    for spec, value in zip(ep.graph_signature.output_specs, out.args[0]):
        if isinstance(value, torch.fx.Node) and isinstance(spec.arg, TensorArgument):
            spec.arg = TensorArgument(name=value.name)


def _under_autocast(body: torch.fx.GraphModule, operands, device, dtype, enabled, cache) -> torch.fx.Graph:
    """``body`` retraced (``make_fx``, fake tensors) under ``torch.autocast``: autocast's casts
    become explicit ``_to_copy`` ops. Each op keeps the module path (``nn_module_stack``) and
    stack trace of the op it was traced from (layer clustering reads them)."""
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*xs):
        with torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache), \
                fx_traceback.preserve_node_meta():
            return torch.fx.Interpreter(body).run(*xs)

    _inline_regions(body)  # nested no_grad regions first: make_fx runs below autograd
    traced = make_fx(run, tracing_mode="fake")(*[a.meta["val"] for a in operands])
    traced.graph.eliminate_dead_code()
    return traced.graph


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, body: torch.fx.Graph, operands, detach: bool) -> None:
    """Copy ``body``'s nodes in place of the region ``node`` (its users read ``getitem(node, i)``).

    With ``detach`` (a no-grad region) every op of the body reads values from outside the region
    (and results of nested regions) through ``aten.detach``, so nothing it computes is tracked by
    autograd, as under ``torch.no_grad()``; nested regions get their operands as they are.
    """
    graph = gm.graph
    env: dict[torch.fx.Node, object] = {}
    outside: set[torch.fx.Node] = set()
    detached: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in body.nodes if n.op == "placeholder"]

    def detached_of(v: torch.fx.Node) -> torch.fx.Node:
        if v not in detached:
            detached[v] = graph.call_function(torch.ops.aten.detach.default, (v,))
            detached[v].meta = {**node.meta, "val": v.meta["val"].detach()}
        return detached[v]

    with graph.inserting_before(node):
        for ph, value in zip(placeholders, operands):
            env[ph] = value
            outside.add(ph)
        for b in body.nodes:
            if b.op == "placeholder":
                continue
            if b.op == "output":
                results = b.args[0]
                break
            if b.op == "get_attr":  # a nested region's subgraph: registered on gm under a fresh name
                target = _fresh_attr(gm, b.target)
                gm.add_submodule(target, getattr(b.graph.owning_module, b.target))
                env[b] = graph.get_attr(target)
                continue
            nested = _hop_name(b.target) is not None
            if detach and not nested and b.target is not operator.getitem:
                lookup = lambda a: detached_of(env[a]) if a in outside and isinstance(env[a], torch.fx.Node) else env[a]  # noqa: E731
            else:
                lookup = lambda a: env[a]  # noqa: E731
            env[b] = graph.node_copy(b, lookup)
            env[b].meta.setdefault("nn_module_stack", node.meta.get("nn_module_stack"))
            env[b].meta.setdefault("stack_trace", node.meta.get("stack_trace"))
            if b.target is operator.getitem and _hop_name(b.args[0].target) is not None:
                outside.add(b)  # a nested region's result: from outside this region's own ops
    results = results if isinstance(results, (tuple, list)) else (results,)
    undetached = {d: v for v, d in detached.items()}
    for user in list(node.users):
        user.replace_all_uses_with(_written_operand(env[results[user.args[1]]], undetached))
        graph.erase_node(user)
    graph.erase_node(node)


def _written_operand(value, undetached: dict[torch.fx.Node, torch.fx.Node]):
    """A no-grad region's result as its readers after the region see it: an in-place op's result
    is the tensor it wrote (``w.mul_(mask)`` under ``torch.no_grad()`` returns ``w``), and a write
    into the region's ``detach`` of an outside value (``undetached``: detach -> value) is a write
    into that value, which they read as it is, tracked by autograd (a parameter pruned in place:
    its later readers read the parameter; they read the detached copy, and its gradient was 0)."""
    while isinstance(value, torch.fx.Node) and isinstance(value.target, torch._ops.OpOverload) and \
            len(written_args(value.target)) == 1:
        value = op_args(value)[written_args(value.target)[0]]
    return undetached.get(value, value)


def _fresh_attr(gm: torch.fx.GraphModule, base: str) -> str:
    k = 0
    while hasattr(gm, f"{base}_inlined{k}"):
        k += 1
    return f"{base}_inlined{k}"


def _fake_run(graph: torch.fx.Graph, params: set[str], store: bool = False,
              mode=None) -> tuple[set[str], set[str]]:
    """Run ``graph`` on fake tensors with ``params`` requiring grad: (nodes whose result requires
    grad when only the parameters do, with exact autograd semantics: a view of data stays
    untracked, for example; placeholders the graph writes in place, ``batch_norm``'s running
    statistics or ``add_`` on a counter, found by their version counters). ``capture`` runs it
    once on export's graph, and again only when that graph had to be functionalized. With
    ``store`` every node's ``meta["val"]`` becomes its value of this run (a graph for any batch
    size, valued from its placeholders' values: ``AnyBatchGraph``). ``mode``: the
    ``FakeTensorMode`` to run in (its placeholders' values already of it), default a new one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracked: set[str] = set()
    inputs: dict[str, tuple[torch.Tensor, int]] = {}
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)

    class Tracker(torch.fx.Interpreter):
        def run_node(self, n):
            if n.op == "placeholder":
                val = n.meta["val"]
                out = val if not isinstance(val, torch.Tensor) or mode.is_our_fake(val) else mode.from_tensor(val)
                if isinstance(out, torch.Tensor):  # only the parameters: export may mark a meta input too
                    out = out.detach().requires_grad_(n.name in params)
                if isinstance(out, torch.Tensor):
                    inputs[n.name] = (out, out._version)
            elif n.target is torch.ops.aten.view.default:  # as the runtime: on any layout (_drop_layout_copies)
                out = torch.ops.aten.reshape.default(*self.map_nodes_to_values(n.args, n))
            else:
                out = super().run_node(n)
            vals = out if isinstance(out, (tuple, list)) else [out]
            if any(isinstance(v, torch.Tensor) and v.requires_grad for v in vals):
                tracked.add(n.name)
            if store and n.op != "output":
                n.meta["val"] = out
            return out

    with mode:
        Tracker(graph.owning_module or torch.nn.Module(), graph=graph).run(
            *[None for n in graph.nodes if n.op == "placeholder"])
    return tracked, {name for name, (t, version) in inputs.items() if t._version != version}


def _write_through_view(graph: torch.fx.Graph) -> str | None:
    """The first in-place op that writes into a view of another tensor (``h[..., :8] *= 0.5`` is a
    ``mul_`` of a ``slice`` and a ``copy_`` into a ``slice``; later ops read the base, written), or
    None. The runtime runs a view on its operand's shard, or on a resharded copy where the plan
    moves it: a write into that copy never reached the base (Megatron's split ``h``: gradients
    3e3 x their bound off, silently). ``capture`` functionalizes such a graph (the write becomes
    ``slice_scatter`` and friends, read by the later ops). A write into a ``detach`` / ``alias``
    of a stored tensor (``ALIAS_OPS``) is the executor's write-back, not this."""
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for name in written_args(node.target):
            src = op_args(node)[name]
            if (isinstance(src, torch.fx.Node) and isinstance(src.target, torch._ops.OpOverload)
                    and src.target.is_view and src.target not in ALIAS_OPS):
                return node.name
    return None


def _is_op(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) or target is operator.getitem


def stage_view(cg, names):
    """``cg`` with only the parameters, buffers and inputs among ``names`` (one stage's share), and
    the in-place updates of those (a stage that receives a buffer's new value from the stage that
    computed it, read after the update, does not store it: it holds no copy of the buffer)."""
    keep = set(names)
    buffers = {k: v for k, v in cg.buffer_fqns.items() if k in keep}
    return replace(cg, param_fqns={k: v for k, v in cg.param_fqns.items() if k in keep}, buffer_fqns=buffers,
                   input_names=[n for n in cg.input_names if n in keep],
                   buffer_mutations={k: v for k, v in cg.buffer_mutations.items()
                                     if k in keep and v in buffers.values()},
                   param_mutations={k: v for k, v in cg.param_mutations.items() if k in keep and v in keep})
