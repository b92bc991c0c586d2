"""Capture a training loss as an aten-level torch.fx graph with global shapes.

``torch.export`` (non-strict) of ``loss = loss_fn(model(*inputs), *targets)`` gives a functional
graph whose placeholders are the parameters, buffers and user inputs, and whose node metadata
carries FakeTensor values (shape, dtype). Models built on the meta device capture without
allocating weights, so a 39B-parameter model plans on a laptop.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import torch
import torch.fx


class CaptureError(RuntimeError):
    """The model (or loss) could not be captured; the message names the construct or op."""


@dataclass
class CapturedGraph:
    """A captured training loss.

    Attributes:
        graph_module: the exported ``torch.fx.GraphModule`` (aten ops, FakeTensor ``meta["val"]``).
        param_fqns: placeholder name -> parameter FQN in the user's model (tied weights share one).
        buffer_fqns: placeholder name -> buffer FQN.
        input_names: placeholder names of the user inputs then targets, in call order.
        loss_name: the node holding the scalar loss.
        tied: parameter FQN -> other FQNs of the same tensor (weight tying).
        buffer_mutations: output node name -> FQN of the buffer it updates (batch-norm statistics).
        requires_grad: names of the nodes whose value autograd tracks (depends on a parameter).
    """

    graph_module: torch.fx.GraphModule
    param_fqns: dict[str, str]
    buffer_fqns: dict[str, str]
    input_names: list[str]
    loss_name: str
    tied: dict[str, list[str]] = field(default_factory=dict)
    buffer_mutations: dict[str, str] = field(default_factory=dict)
    requires_grad: set[str] = field(default_factory=set)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def node(self, name: str) -> torch.fx.Node:
        return self._by_name[name]

    def __post_init__(self):
        self._by_name = {n.name: n for n in self.graph.nodes}

    def fingerprint(self) -> str:
        """Hash of the graph's ops and shapes; a plan records it to detect another model."""
        h = hashlib.sha256()
        for n in self.graph.nodes:
            h.update(f"{n.name}|{n.op}|{n.target}|{tuple(shape_of(n) or ())}\n".encode())
        return h.hexdigest()[:16]


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


class _Loss(torch.nn.Module):
    """``forward(*inputs, *targets) -> scalar loss`` around the user's model and loss_fn."""

    def __init__(self, model: torch.nn.Module, loss_fn, num_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs

    def forward(self, *args):
        out = self.model(*args[: self.num_inputs])
        if self.loss_fn is not None:
            return self.loss_fn(out, *args[self.num_inputs:])
        if isinstance(out, dict) or hasattr(out, "loss"):
            out = out["loss"] if isinstance(out, dict) else out.loss
        return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def capture(model: torch.nn.Module, example_inputs: tuple, loss_fn=None, targets: tuple = ()) -> CapturedGraph:
    """Capture ``loss_fn(model(*example_inputs), *targets)`` (or the model's own scalar loss).

    Args:
        model: the module; parameters may live on the meta device.
        example_inputs: model inputs with GLOBAL shapes (real, meta or fake tensors).
        loss_fn: ``loss_fn(output, *targets) -> scalar``; None when the model returns its loss
            (a scalar tensor, or an output with ``.loss`` such as HuggingFace models with labels).
        targets: extra tensors passed to ``loss_fn``.

    Raises:
        CaptureError: torch.export failed (the message names the construct or op), or the
            captured value is not a scalar loss.
    """
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    args = tuple(example_inputs) + tuple(targets)
    wrapper = _Loss(model, loss_fn, len(example_inputs))
    try:
        ep = torch.export.export(wrapper, args, strict=False)
    except Exception as first:  # noqa: BLE001 - reported with its construct below
        try:  # plain modules: symbolic_trace's python-level graph sometimes exports when the module does not
            traced = torch.fx.symbolic_trace(wrapper)
            ep = torch.export.export(traced, args, strict=False)
        except Exception:  # noqa: BLE001
            raise CaptureError(f"cannot capture {type(model).__name__}: {_first_line(first)}") from first
    gm = ep.graph_module
    sig = ep.graph_signature
    strip = lambda fqn: fqn[len("model."):] if fqn.startswith("model.") else fqn  # noqa: E731
    param_fqns = {k: strip(v) for k, v in sig.inputs_to_parameters.items()}
    buffer_fqns = {k: strip(v) for k, v in sig.inputs_to_buffers.items()}
    input_names = list(sig.user_inputs)
    outputs = list(sig.user_outputs)
    if len(outputs) != 1:
        raise CaptureError(f"the loss must be one scalar tensor, the model returned {len(outputs)} outputs")
    loss = next(n for n in gm.graph.nodes if n.name == outputs[0])
    shape = shape_of(loss)
    if shape is None or len(shape) != 0:
        raise CaptureError(f"the captured output has shape {shape}, not a scalar loss; pass loss_fn=")
    unsupported = [n for n in gm.graph.nodes if n.op == "call_function" and not _is_op(n.target)]
    if unsupported:
        raise CaptureError(f"unsupported construct in the graph: {unsupported[0].target}")
    # weight tying: one placeholder for several names of the same tensor; record the other names
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    tied = {fqn: [n for n in group if n != fqn] for group in names.values() if len(group) > 1
            for fqn in group if fqn in param_fqns.values()}
    mutations = {k: strip(v) for k, v in sig.buffers_to_mutate.items()}
    return CapturedGraph(gm, param_fqns, buffer_fqns, input_names, loss.name, tied, mutations,
                         _tracked_by_autograd(gm, set(param_fqns)))


def _tracked_by_autograd(gm: torch.fx.GraphModule, params: set[str]) -> set[str]:
    """Nodes whose result requires grad when only the parameters do, found by running the graph
    on fake tensors (exact autograd semantics: a view of data stays untracked, for example)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracked: set[str] = set()
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    class Tracker(torch.fx.Interpreter):
        def run_node(self, n):
            if n.op == "placeholder":
                val = n.meta["val"]
                out = mode.from_tensor(val) if isinstance(val, torch.Tensor) else val
                out = out.detach().requires_grad_(True) if n.name in params else out
            else:
                out = super().run_node(n)
            vals = out if isinstance(out, (tuple, list)) else [out]
            if any(isinstance(v, torch.Tensor) and v.requires_grad for v in vals):
                tracked.add(n.name)
            return out

    with mode:
        Tracker(gm).run(*[None for n in gm.graph.nodes if n.op == "placeholder"])
    return tracked


def _is_op(target) -> bool:
    import operator
    return isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) or target is operator.getitem


def stage_view(cg, names):
    """``cg`` with only the parameters, buffers and inputs among ``names`` (one stage's share)."""
    keep = set(names)
    return replace(cg, param_fqns={k: v for k, v in cg.param_fqns.items() if k in keep},
                   buffer_fqns={k: v for k, v in cg.buffer_fqns.items() if k in keep},
                   input_names=[n for n in cg.input_names if n in keep],
                   buffer_mutations={k: v for k, v in cg.buffer_mutations.items() if k in keep})
