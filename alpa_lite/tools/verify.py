"""``alpa_lite.tools.verify``: does a plan train like one process?

Runs the single-process reference (on rank 0) and the parallel run of a plan (on every rank) on
the same batches from the same weights, and compares, per step, the loss and every gradient,
and after the last step every parameter and buffer. The answer is a :class:`VerifyReport` with
the largest difference of each tensor, the bound it was held to and a verdict.

Tolerances (per dtype; ``RTOL``). A sharded run sums the same products in another order (a
matmul split along its contracted dim adds partial sums; an all-reduce adds shards in ring
order), so fp32 results differ by rounding: about 1e-6 relative for the matmuls of small models
(``tests/test_runtime.py``). We allow ``RTOL[fp32] = 1e-4`` relative: 100x headroom for depth and
steps, while a wrong plan (a missing gradient all-reduce, a wrong shard) is off by O(1) relative.
The other dtypes get the same headroom over their unit roundoff. Each tensor is compared with

    bound = RTOL[dtype] * max(scale, FLOOR * scale of its kind) + 4 * eps[dtype] * max|reference|

where ``scale`` is the tensor's own magnitude: ``max|g|`` for a gradient, ``max|p_final - p_init|``
(the reference's update) for a parameter, ``max|b|`` for a buffer, ``|loss|`` for a loss. The
update, not the weight, is the scale of a parameter: a wrong update of a large weight is small
next to the weight and would pass a weight-relative test. ``FLOOR`` (1e-3 of the largest value
of the kind in the model) keeps tensors whose true value is a cancellation of rounding noise (a
bias before a batch norm has gradient ~0) from failing on noise; the ``eps`` term is the
rounding of storing the result. Integer buffers must be equal. A tensor the parallel run lacks,
or a gradient only one side has (a frozen parameter that was trained), differs.

The default optimizer is SGD (lr 1e-2): a gradient maps linearly to an update and exact zeros
stay zero. AdamW divides each update by the root of the second moment, which turns the rounding
of a near-zero gradient into a full step; pass ``optimizer=`` to check it anyway, knowing that
its parameters may then exceed these bounds for reasons of arithmetic, not of the plan.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..core.options import compute_dtype_of
from ..core.plan import PipelinePlan
from ..core.schedules import SCHEDULES
from .display import count

RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
"""Relative tolerance per dtype (see the module docstring)."""
FLOOR = 1e-3
"""A tensor's scale is at least this share of the largest scale of its kind."""


def sgd(params, lr: float = 1e-2) -> torch.optim.Optimizer:
    """The default optimizer of :func:`verify`: plain SGD, ``lr`` 1e-2, no momentum."""
    return torch.optim.SGD(params, lr=lr)


@dataclass
class Row:
    """One compared tensor: ``kind`` is loss / grad / param / buffer; ``step`` the worst step
    (grads and losses; -1 for final values); ``max_diff`` and ``bound`` are absolute; ``note``
    says why a row differs without a number (absent, unexpected gradient)."""

    kind: str
    name: str
    dtype: str
    max_diff: float
    bound: float
    step: int = -1
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.note and self.max_diff <= self.bound


@dataclass
class VerifyReport:
    """The answer of :func:`verify`: ``equal`` is True when every row is within its bound.

    Attributes:
        rows: every compared tensor (losses of each step, gradients of each parameter (worst step),
            final parameters and buffers).
        losses / ref_losses: the parallel and single-process loss of each step.
        plan: a one-line description of the plan (stages, mesh, parameter specs that are not
            replicated).
        tolerance: ``RTOL`` by dtype name, and ``FLOOR``.
        random_ops: the random ops of the model's graph (:func:`random_ops`): the two runs draw
            different numbers for them, so a difference can be theirs, not the plan's.
    """

    rows: list[Row]
    losses: list[float]
    ref_losses: list[float]
    plan: str
    tolerance: dict = field(default_factory=lambda: {"rtol": {str(k): v for k, v in RTOL.items()}, "floor": FLOOR})
    random_ops: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def differing(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def to_dict(self) -> dict:
        return {"verdict": "equal" if self.equal else "differs", "plan": self.plan, "losses": self.losses,
                "ref_losses": self.ref_losses, "tolerance": self.tolerance, "random_ops": self.random_ops,
                "rows": [asdict(r) | {"ok": r.ok} for r in self.rows]}

    def table(self, max_rows: int = 40):
        """A rich ``Table``: the differing rows first, then the largest ratios diff / bound."""
        from rich.table import Table

        verdict = "[green]equal[/]" if self.equal else f"[red]differs[/] ({len(self.differing)} tensors)"
        t = Table(title=f"verify: {verdict} to one process; {self.plan}")
        if self.random_ops:
            t.title += f"\n[yellow]{_random_note(self.random_ops)}[/]"
        for col in ("kind", "tensor", "dtype", "step", "max |diff|", "bound", ""):
            t.add_column(col, justify="right" if col in ("step", "max |diff|", "bound") else "left")
        ranked = sorted(self.rows, key=_badness, reverse=True)
        for r in ranked[:max_rows]:
            t.add_row(r.kind, r.name, r.dtype, "" if r.step < 0 else str(r.step), f"{r.max_diff:.3g}",
                      f"{r.bound:.3g}", "ok" if r.ok else f"[red]{r.note or 'DIFFERS'}[/]")
        if len(ranked) > max_rows:
            t.caption = f"{len(ranked) - max_rows} more rows within bounds"
        return t


def _eps(dtype: torch.dtype) -> float:
    dtype = dtype.to_real() if dtype.is_complex else dtype  # a complex tensor: its parts' (sweep 12)
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _rtol(dtype: torch.dtype) -> float:
    return RTOL.get(dtype.to_real() if dtype.is_complex else dtype, 0.0)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64, or complex128 when complex: ``.double()`` of a complex tensor drops its
    imaginary part (sweep 12: a complex parameter's gradient was compared by its real part only,
    to a bound of 0, and the imaginary part the trainer lost went unseen)."""
    return x.detach().to(torch.complex128 if x.is_complex() else torch.float64)


def _amax(x: torch.Tensor) -> float:
    """``max |x|`` over the finite elements as a float, 0 for a tensor without any; any dtype (a
    bool buffer: a causal mask). An infinite element (a ``-inf`` mask buffer) is no scale: it
    would make the bound of its tensor, and through ``FLOOR`` of every tensor of its kind, infinite."""
    x = _wide(x).abs()
    x = x[torch.isfinite(x)]
    return float(x.max()) if x.numel() else 0.0


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|``; elements equal in both count 0 (the same infinity: ``inf - inf`` is NaN),
    an infinity or NaN in one only gives ``inf`` or NaN (differs)."""
    if a.shape != b.shape:
        return math.inf
    a, b = _wide(a), _wide(b)
    d = (a - b).abs().masked_fill(a == b, 0.0)
    return float(d.max()) if d.numel() else 0.0


def _compare(kind: str, got: dict, want: dict, scale: dict, step: int = -1, compute: torch.dtype | None = None
             ) -> list[Row]:
    """Rows for ``want``'s tensors (by name): ``got`` may lack some (absent) or have extras.
    ``compute``: the dtype both runs computed in (mixed precision), whose tolerance a floating
    tensor gets when it is the larger."""
    top = max([*scale.values(), 0.0])
    rows = []
    for name, ref in want.items():
        if name not in got:
            rows.append(Row(kind, name, str(ref.dtype).removeprefix("torch."), math.inf, 0.0, step,
                            "absent from the parallel run"))
            continue
        s = max(scale[name], FLOOR * top)
        rtol = max(_rtol(ref.dtype), _rtol(compute)) if compute is not None and (
            ref.is_floating_point() or ref.is_complex()) else _rtol(ref.dtype)
        bound = rtol * s + 4 * _eps(ref.dtype) * _amax(ref)
        rows.append(Row(kind, name, str(ref.dtype).removeprefix("torch."), _diff(got[name].cpu(), ref.cpu()),
                        bound, step))
    for name in sorted(set(got) - set(want)):
        if kind == "grad" and not got[name].ne(0).any():  # a parameter no op used: the trainer reports zeros
            rows.append(Row(kind, name, str(got[name].dtype).removeprefix("torch."), 0.0, 0.0, step))
            continue
        rows.append(Row(kind, name, str(got[name].dtype).removeprefix("torch."), math.inf, 0.0, step,
                        "only the parallel run has it" if kind == "grad" else "not in the model"))
    return rows


def _badness(r: Row) -> tuple[bool, float]:
    return not r.ok, r.max_diff / r.bound if r.bound else math.inf


def _worst(rows: list[Row]) -> list[Row]:
    """Per (kind, name): the row of the step with the largest diff / bound."""
    worst: dict[tuple[str, str], Row] = {}
    for r in rows:
        key = (r.kind, r.name)
        if key not in worst or _badness(r) > _badness(worst[key]):
            worst[key] = r
    return list(worst.values())


@dataclass
class _Trace:
    """What one run produced: losses and gradients of each step, initial and final state."""

    init: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def _reference(model, batches, loss_fn, num_inputs: int, optimizer: Callable, device,
               compute_dtype: torch.dtype | None = None, max_grad_norm: float | None = None) -> _Trace:
    """Train a copy of ``model`` in this process (the loss exactly as ``capture`` wraps it, in
    ``compute_dtype`` under mixed precision; the gradients clipped to ``max_grad_norm`` by
    ``torch.nn.utils.clip_grad_norm_`` when given, as the trainer's ``step`` clips them);
    ``batches``: ``(args, kwargs)`` pairs."""
    import torch.utils._pytree as pytree

    from ..core.capture import TrainingLoss

    wrapped = TrainingLoss(copy.deepcopy(model), loss_fn, num_inputs, compute_dtype).to(device)
    trained = [p for p in wrapped.parameters() if p.requires_grad]
    opt = optimizer(trained)
    trace = _Trace({k: v.detach().cpu().clone() for k, v in model.named_parameters(remove_duplicate=False)})
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        args, kwargs = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)
        loss = wrapped(*args, **kwargs)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
        # tied names too, as trainer.gradients(); a sparse gradient (Embedding(sparse=True)) dense, as the trainer's
        trace.grads.append({k: p.grad.detach().to_dense().cpu().clone()
                            for k, p in wrapped.model.named_parameters(remove_duplicate=False) if p.grad is not None})
        opt.step()
        trace.losses.append(float(loss.detach()))
    m = wrapped.model
    trace.params = {k: v.detach().cpu() for k, v in m.named_parameters(remove_duplicate=False)}
    trace.buffers = {k: v.detach().cpu() for k, v in m.named_buffers(remove_duplicate=False)}
    return trace


def _parallel(trainer, batches, names: set[str]) -> _Trace:
    trace = _Trace()
    for args, kwargs in batches:
        trace.losses.append(trainer.step(*args, **kwargs))
        trace.grads.append(trainer.gradients())
    state = trainer.state_dict(non_persistent=True)
    trace.params = {k: v for k, v in state.items() if k in names}
    trace.buffers = {k: v for k, v in state.items() if k not in names}
    return trace


def _plan_line(plan) -> str:
    if isinstance(plan, PipelinePlan):
        inner = "; ".join(f"stage {i}: {s.plan.mesh.shape[0]}x{s.plan.mesh.shape[1]}"
                          for i, s in enumerate(plan.stages))
        return (f"{count(len(plan.stages), 'stage', 'stages')} ({inner}), "
                f"{count(plan.num_microbatches, 'microbatch', 'microbatches')}, {plan.schedule}")
    split = sum(1 for s in plan.param_specs.values() if s.axes())
    return f"mesh {plan.mesh.shape[0]}x{plan.mesh.shape[1]}, {split} of {len(plan.param_specs)} parameters sharded"


def _judge(ref: _Trace, par: _Trace, plan_line: str, compute: torch.dtype | None = None) -> VerifyReport:
    rows = []
    for i, (a, b) in enumerate(zip(par.losses, ref.losses)):
        t = torch.tensor(b)
        rows += _compare("loss", {"loss": torch.tensor(a)}, {"loss": t}, {"loss": abs(b)}, i, compute)
    for i, (got, want) in enumerate(zip(par.grads, ref.grads)):
        if got is not None:
            rows += _compare("grad", got, want, {k: _amax(v) for k, v in want.items()}, i, compute)
    update = {k: _amax(v - ref.init[k]) if v.is_floating_point() or v.is_complex() else 0.0
              for k, v in ref.params.items()}
    rows += _compare("param", par.params, ref.params, update, compute=compute)
    rows += _compare("buffer", par.buffers, ref.buffers, {k: _amax(v) if v.is_floating_point() or v.is_complex() else 0.0
                                                           for k, v in ref.buffers.items()}, compute=compute)
    return VerifyReport(_worst(rows), par.losses, ref.losses, plan_line)


def random_ops(cg) -> list[str]:
    """The random ops of ``cg``'s graph (``aten.is_random``: dropout, ``bernoulli``, ``rand_like``,
    attention dropout ...) as ``"op in module (class)"``; a dropout of probability 0 or with
    ``training=False``, and attention of ``dropout_p=0`` (``nn.MultiheadAttention``'s in eval or
    without dropout), left out. The parallel
    run draws from generators seeded per op and shard, the reference from torch's one generator,
    so their masks differ and :func:`verify` cannot compare such a model to rounding (sweep 12: a
    ``nn.Dropout(0.1)`` model "differed" under every plan, gradients 1e2 to 1e4 times their bound,
    and nothing said why)."""
    from ..core.aten import bind_args, is_random

    found = []
    for n in cg.graph.nodes:
        if n.op != "call_function" or not is_random(n.target):
            continue
        name = str(n.target).removesuffix(".default")
        a = bind_args(n.target, n.args, n.kwargs)
        if a.get("dropout_p", 1) == 0 or "dropout" in name and (a.get("p") == 0 or a.get("train") is False):
            continue  # attention without dropout; a dropout of p = 0 or with training=False: the identity
        path, kind = list((n.meta.get("nn_module_stack") or {"": ("", "")}).values())[-1]
        path = path.removeprefix("model").removeprefix(".")  # capture's TrainingLoss holds the model as .model
        kind = str(getattr(kind, "__name__", kind)).rpartition(".")[2]
        where = f"{path} ({kind})" if path else "the model's forward"
        found.append(f"{name} in {where}")
    return list(dict.fromkeys(found))


def _random_note(ops: list[str]) -> str:
    return (f"the model draws random numbers ({', '.join(ops)}): the parallel run and one process draw different "
            "ones, so they differ by more than rounding wherever those ops matter; to compare a plan, set dropout "
            "probabilities to 0 (or those modules to eval()) for verify")


def _low_precision(cg) -> torch.dtype | None:
    """The low-precision float dtype (of ``RTOL``'s, the loosest) that ``cg`` computes some values
    in without mixed precision: a ``torch.autocast`` region inside the model's ``forward``
    (capture inlines its casts), a layer kept in bf16. Both runs compute those values in it, summed
    in another order on a sharded run (a batch split into partial products rounded to bf16 each),
    so they agree to its rounding, not to fp32's: verify held such a model to fp32's bounds and
    called every plan of it different (sweep 7: ``torch.autocast("cpu", bfloat16)`` around an
    MLP, gradients 6e-5 to 2.4e-4 apart under data parallel, Megatron, ZeRO-3 and a pipeline, fp32
    bound 1.3e-6). Likewise fp32 in a model that also computes in float64 (a head kept in float64
    after fp32 layers, sweep 12: its float64 gradients carry the fp32 rounding of their inputs,
    5e-8 relative, and were held to float64's 1e-10). None when every float value is fp32 or
    wider and the model computes in one float dtype."""
    floats = {v.dtype.to_real() if v.dtype.is_complex else v.dtype for n in cg.graph.nodes
              for v in pytree.tree_leaves(n.meta.get("val"))
              if isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)}
    low = floats & {torch.bfloat16, torch.float16}
    if not low and len(floats) > 1:
        low = floats
    return max(low, key=_rtol) if low else None


def _call(batch, keywords: bool) -> tuple[tuple, dict]:
    """A batch of :func:`verify` as the ``(args, kwargs)`` of one call."""
    if not keywords:
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], dict):
        return tuple(batch[0]), batch[1]
    raise ValueError("with example_kwargs, each batch is a ((*inputs, *targets), kwargs) pair or a kwargs dict; "
                     f"got {type(batch).__name__}")


def verify(model: torch.nn.Module, inputs, mesh, *, loss_fn: Callable | None = None, targets: tuple = (),
           example_kwargs: dict | None = None, batches: list | None = None, steps: int = 3,
           optimizer: Callable = sgd, plan=None, show: bool = True, console=None, **plan_options) -> VerifyReport:
    """Train ``model`` with a plan and in one process on the same batches; compare (every rank).

    Args:
        model: the module with real weights (CPU; moved to the rank's device as the trainer does:
            CUDA when available, else CPU). Neither run changes it.
        inputs: model inputs with GLOBAL shapes (a tensor or a tuple, nested tuples / lists /
            dicts of tensors too, as ``parallelize`` takes them); ``targets`` follow them.
        mesh: a 2D ``DeviceMesh`` or a shape such as ``(2, 2)`` for the current world.
        loss_fn: ``loss_fn(output, *targets)``; None when the model returns its loss.
        example_kwargs: keyword inputs of the model (HuggingFace's ``input_ids=``, ``labels=``).
        batches: the batches of each step, global shapes: ``(*inputs, *targets)`` tuples; with
            ``example_kwargs``, ``((*inputs, *targets), kwargs)`` pairs, or just the ``kwargs``
            dict when the model takes only keyword inputs (``model(**batch)``). Default:
            ``steps`` times the example batch.
        optimizer: ``params -> torch.optim.Optimizer`` for both runs; default :func:`sgd`.
        plan: a ``Plan`` or plan JSON path; None plans with ``plan_options`` (``alpa_lite.plan``'s
            options: ``force_data_parallel``, ``param_specs``, ``pipeline`` ...).
        show: print the report table on rank 0 (to ``console``, a rich ``Console``).

    Returns:
        The same :class:`VerifyReport` on every rank (rank 0's comparison, broadcast).

    Raises:
        ValueError: the model has meta (unmaterialized) weights, no step is asked for, or a batch
            is not of the form above.
        PlanError: (from ``parallelize``) the plan does not fit the model or the mesh.
        RuntimeError: the one-process reference or the comparison failed on rank 0 (raised on
            every rank, naming rank 0's error).
        CaptureError: (from ``core.capture.check_backward_hooks``, on every rank) the model has a
            backward hook, which neither run would honour.
    """
    from ..api import parallelize
    from ..core.capture import check_backward_hooks
    from ..runtime.launch import default_device

    if any(p.is_meta for p in model.parameters()):
        raise ValueError("verify needs a model with real weights (build it on the CPU, not on 'meta')")
    check_backward_hooks(model)  # before the copies: deepcopy drops a parameter's hooks, in both runs
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    example = ((*inputs, *targets), dict(example_kwargs)) if example_kwargs is not None else (*inputs, *targets)
    batches = [_call(b, example_kwargs is not None) for b in ([example] * steps if batches is None else batches)]
    if not batches:
        raise ValueError(f"verify needs at least one step, got steps={steps}")
    trainer = parallelize(copy.deepcopy(model), mesh, inputs, loss_fn, targets=tuple(targets),
                          example_kwargs=example_kwargs, optimizer=optimizer, plan=plan, **plan_options)
    compute = compute_dtype_of(trainer.plan.options)  # mixed precision: the reference computes alike
    par = _parallel(trainer, batches, {k for k, _ in model.named_parameters(remove_duplicate=False)})
    box: list = [None]
    if dist.get_rank() == 0:  # the reference after the parallel run: an error here cannot strand the other ranks
        try:
            ref = _reference(model, batches, loss_fn, len(inputs), optimizer, default_device(), compute,
                             plan_options.get("max_grad_norm"))
            box[0] = _judge(ref, par, _plan_line(trainer.plan), compute or _low_precision(trainer.cg))
            box[0].random_ops = random_ops(trainer.cg)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            box[0] = e
    failure = box[0] if isinstance(box[0], Exception) else None
    if failure is not None:
        box[0] = f"{type(failure).__name__}: {failure}"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RuntimeError(f"verify failed on rank 0 (the one-process reference or the comparison): {box[0]}"
                           ) from failure
    report = box[0]
    if report.random_ops and dist.get_rank() == 0:
        import warnings
        warnings.warn(f"verify: {_random_note(report.random_ops)}", stacklevel=2)
    if show and dist.get_rank() == 0:
        from rich.console import Console
        (console or Console()).print(report.table())
    return report


# ------------------------------------------------------------------------------------ command line

def add_arguments(p) -> None:
    """``alpa-lite verify``'s options."""
    from ..zoo.models import MODEL_NAMES
    p.add_argument("model", help=f"built-in model ({', '.join(MODEL_NAMES)}) or module:callable "
                                 "returning (model, example_inputs)")
    p.add_argument("--mesh", default="2x2", help="logical mesh over the processes (default 2x2)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: the mesh's size)")
    p.add_argument("--steps", type=int, default=3, help="training steps compared (default 3)")
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=None, help="sequence length (language models)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                   help="sgd (default: exact zeros stay zero) or adamw (amplifies rounding)")
    p.add_argument("--plan", default=None, help="verify this plan JSON instead of planning")
    p.add_argument("--cluster", default=None, help="preset or cluster JSON to plan with (default as the trainer)")
    p.add_argument("--force-dp", "--force-data-parallel", dest="force_dp", action="store_true",
                   help="pure data parallel")
    p.add_argument("--batch-axis", type=int, choices=(0, 1), default=None, help="force the batch onto a mesh axis")
    p.add_argument("--param-specs", default=None, metavar="JSON",
                   help='force parameter specs, e.g. \'{"layers.0.weight": "S1R"}\'')
    p.add_argument("--pipeline", default=None, metavar="auto|K", help="pipeline stages: 'auto' or a stage count")
    p.add_argument("--schedule", default="1f1b", choices=(*SCHEDULES, "auto"),
                   help="pipeline schedule ('auto': the least predicted step time that fits memory)")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches")
    p.add_argument("--layers", type=int, default=None, help="layers to cluster the graph into")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON here")


def _plan_options(args) -> dict:
    opts = {"force_data_parallel": True} if args.force_dp else {}
    if args.batch_axis is not None:
        opts["batch_axis"] = args.batch_axis
    if args.param_specs:
        opts["param_specs"] = json.loads(args.param_specs)
    if args.pipeline is not None:
        opts |= {"pipeline": int(args.pipeline) if args.pipeline.isdigit() else args.pipeline,
                 "schedule": args.schedule, "num_microbatches": args.microbatches, "num_layers": args.layers}
    if args.cluster:
        opts["cluster"] = args.cluster
    return opts


def _worker(args) -> int:
    from ..runtime.launch import init_distributed
    from ..core.mesh import parse_mesh_shape
    from ..zoo.models import build_model

    init_distributed(120)
    model, example = build_model(args.model, args.batch, args.seq, device="cpu")
    builtin = ":" not in args.model  # built-ins take a seed: a different batch each step
    batches = [build_model(args.model, args.batch, args.seq, device="cpu", seed=100 + s)[1] if builtin else example
               for s in range(args.steps)]
    opt = (lambda ps: sgd(ps, args.lr)) if args.optimizer == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=args.lr))
    report = verify(model, example, parse_mesh_shape(args.mesh), batches=batches, optimizer=opt, plan=args.plan,
                    **_plan_options(args))
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0  # init_distributed's exit handler: a barrier, then the group destroyed


def main(args) -> int:
    """Entry of ``alpa-lite verify``: launch the ranks (``launch.torchrun``) unless already one.

    Returns 0 when the plan trains like one process, 1 when it differs, 2 when a rank failed (an
    error, not a verdict: its message is in the ranks' output), as the CLI's other errors. Rank 0
    prints the report; ``--json PATH`` also writes it (``VerifyReport.to_dict``).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _worker(args)
    from ..runtime.launch import torchrun
    from ..core.mesh import parse_mesh_shape

    n0, n1 = parse_mesh_shape(args.mesh)  # bad input fails here, once, not on every rank
    nproc = args.nproc or n0 * n1
    if n0 * n1 != nproc:
        raise ValueError(f"mesh {args.mesh} has {n0 * n1} devices but --nproc is {nproc}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.param_specs:
        json.loads(args.param_specs)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.json or os.path.join(tmp, "verify.json")
        options = {k: v for k, v in vars(args).items() if k not in ("func", "command")} | {"json": out}
        code = torchrun(["-m", "alpa_lite.tools.verify", json.dumps(options)], nproc=nproc)
        if code != 0:
            print(f"alpa-lite verify: a rank failed (launcher exit code {code}); no verdict", file=sys.stderr)
            return 2
        with open(out) as f:
            return 0 if json.load(f)["verdict"] == "equal" else 1


if __name__ == "__main__":
    import argparse
    sys.exit(main(argparse.Namespace(**json.loads(sys.argv[1]))))
