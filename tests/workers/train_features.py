"""Run on every rank by torchrun: gradient accumulation, global-norm clipping and sharded
checkpoints (resumed under other plans) vs one process on the same batches. Rank 0 writes one
JSON record per case.

The model is the built-in GPT (tied embedding, token-mean cross-entropy) with some targets set to
``ignore_index`` (-100), a different count per row, and none valid in rows 0-1 of the first
batch: a microbatch of 2 rows then has no valid target at all.
"""
import argparse
import copy
import importlib.util
import math
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from alpa_lite import parallelize
from alpa_lite.runtime import collective_counts
from alpa_lite.runtime.checkpoint import CheckpointError
from alpa_lite.runtime.launch import init_distributed
from alpa_lite.zoo.models import build_model
from single_process import finish, reference

BATCH, SEQ, STEPS, LR = 8, 16, 4, 1e-2
MEGATRON = {"batch_axis": 0, "param_specs": {f"blocks.{i}.{m}": s for i in range(2) for m, s in (
    ("attn.qkv.weight", "S1R"), ("attn.proj.weight", "RS1"), ("ffn.fc.weight", "S1R"), ("ffn.proj.weight", "RS1"))}}
ZERO3 = {"force_data_parallel": True, "param_specs": {f"blocks.{i}.{m}.weight": "S01R" for i in range(2)
                                                      for m in ("attn.qkv", "attn.proj", "ffn.fc", "ffn.proj")}}
PLANS = {  # name -> (mesh, options)
    "dp": ((2, 2), {"force_data_parallel": True}),
    "dp_1x4": ((1, 4), {"force_data_parallel": True}),
    "megatron": ((2, 2), MEGATRON),
    "2d": ((2, 2), {"param_specs": {k: v.replace("S1", "S01") for k, v in MEGATRON["param_specs"].items()}}),
    "zero3": ((2, 2), ZERO3),
    "zero2": ((2, 2), {"force_data_parallel": True, "zero_stage": 2}),
    "zero1": ((2, 2), {"force_data_parallel": True, "zero_stage": 1}),
    "pipeline": ((1, 4), {"num_stages": 2, "num_microbatches": 2, "num_layers": 2}),
    "pipeline_4x1": ((1, 4), {"num_stages": 4, "num_microbatches": 4}),
    # interleaved 1F1B: 4 stages on 2 device groups of 2, each rank holding 2 stages (chunks)
    "interleaved": ((2, 2), {"num_stages": 4, "schedule": "interleaved", "num_microbatches": 2, "num_layers": 6}),
    "auto": ((2, 2), {}),
    "dp_1x2": ((1, 2), {"force_data_parallel": True}),  # --resume: 2 ranks
    "auto_1x2": ((1, 2), {}),
}


def make_batches():
    out = []
    for s in range(STEPS):
        idx, targets = build_model("gpt-tiny", BATCH, SEQ, device="cpu", seed=100 + s)[1]
        targets = targets.clone()
        for row in range(BATCH):
            targets[row, :(row * 5 + s * 3) % (SEQ + 1)] = -100
        if s == 0:
            targets[:2] = -100
        out.append((idx, targets))
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


PLANNED = {}  # plan name -> the plan the first trainer of that name made (later ones reuse it)


def train(model, plan, batches, steps, optimizer=adamw, **kw):
    """A trainer of ``plan`` and its losses of the first ``steps`` batches."""
    mesh, options = PLANS[plan]
    planned = {"plan": PLANNED[plan]} if plan in PLANNED else options
    trainer = parallelize(copy.deepcopy(model), mesh, batches[0], optimizer=optimizer, **planned, **kw)
    PLANNED[plan] = trainer.plan
    return trainer, [trainer.step(*b) for b in batches[:steps]]


def err(got: dict, want: dict) -> float:
    return max(float((got[k] - v).abs().max()) for k, v in want.items())


def same_on_every_rank(x: float) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, x)
    return len(set(values)) == 1


def reference_sgd(model, batches, max_norm):
    """One process, SGD with ``clip_grad_norm_(max_norm)``: (the global norms before clipping,
    the final parameters)."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    norms = []
    for b in batches:
        opt.zero_grad()
        m(*b).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)))
        opt.step()
    return norms, {k: v.detach() for k, v in m.named_parameters(remove_duplicate=False)}


def step_counts(trainer, batch) -> tuple[dict, dict, dict]:
    """Collectives of one ``trainer.step(*batch)`` by ``"kind|phase"``, and the plan's (made for one
    microbatch) split into those of a microbatch and those of a step (gradient buckets, updates)."""
    before = collective_counts()
    loss = trainer.step(*batch)
    ran = {f"{k}|{ph}": n - before.get((k, ph), 0) for (k, ph), n in collective_counts().items()
           if n != before.get((k, ph), 0)}
    per_microbatch, per_step = {}, {}
    for c in trainer.plan.collectives:
        once = c.phase == "update" or c.node.startswith("gradient bucket")
        counts = per_step if once else per_microbatch
        counts[f"{c.kind}|{c.phase}"] = counts.get(f"{c.kind}|{c.phase}", 0) + 1
    return loss, ran, {"per_microbatch": per_microbatch, "per_step": per_step}


def accumulation_and_clipping(model, batches) -> dict:
    """K microbatches, one update: the whole batch's loss, gradients and parameters; the global
    norms (2 and inf) of their gradients equal one process's; the step's collectives: the
    plan's per microbatch K times, its gradient buckets once. ``max_grad_norm`` on the other
    plans: the norm before clipping and the clipped SGD run equal one process's."""
    ref_losses, ref_grads, ref_params = reference(model, batches[:2], LR)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    norms, _ = reference_sgd(model, batches[:1], math.inf)
    out = {"ref_norm": norms[0], "ref_inf": scale}
    for plan, k in (("megatron", 4), ("dp", 2)):
        trainer = parallelize(copy.deepcopy(model), PLANS[plan][0], batches[0], optimizer=adamw, accumulate=k,
                              **PLANS[plan][1])
        loss, ran, plan_counts = step_counts(trainer, batches[0])
        grads = trainer.gradients()
        norm, inf = float(trainer.grad_norm()), float(trainer.grad_norm(math.inf))
        losses = [loss, trainer.step(*batches[1])]
        out[f"{plan}_k{k}"] = {"losses": losses, "ref_losses": ref_losses, "grad_err": err(grads, ref_grads) / scale,
                               "grad_rel": max(float((grads[n] - g).norm() / g.norm()) for n, g in ref_grads.items()),
                               "runtime_counts": ran, **plan_counts,  # microbatches back-propagated:
                               "valid_microbatches": sum(bool((t != -100).any()) for t in batches[0][1].chunk(k)),
                               "loss_deferred": any(c.deferred for c in trainer.plan.collectives),
                               "param_err": err(trainer.state_dict(), ref_params), "norm": norm, "inf": inf,
                               "same": same_on_every_rank(norm),
                               "micro_rows": int(trainer.cg.node(trainer.cg.input_names[0]).meta["val"].shape[0])}
    max_norm = norms[0] / 3
    ref_norms, ref_clipped = reference_sgd(model, batches[:2], max_norm)
    out["unclipped_move"] = err(reference_sgd(model, batches[:2], math.inf)[1], ref_clipped)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731 - SGD: a clipped step moves by less
    for plan in ("dp", "megatron", "2d", "zero3", "zero2", "zero1", "pipeline"):
        trainer, _ = train(model, plan, batches, 1, optimizer=sgd, max_grad_norm=max_norm)
        first = trainer.last_grad_norm
        trainer.step(*batches[1])
        out[f"clipped_{plan}"] = {"norm": first, "same": same_on_every_rank(first),
                                  "param_err": err(trainer.state_dict(), ref_clipped)}
    return out


def full_export(trainer, path: Path, ref_params: dict) -> dict | None:
    """``trainer.save_full(path)`` read back: its names vs ``trainer.state_dict()``'s and the
    single-process model's, whether its tensors equal ``state_dict()``'s, and how far they are
    from ``ref_params``. None for a ``.safetensors`` path without the safetensors package."""
    if path.suffix == ".safetensors" and importlib.util.find_spec("safetensors") is None:
        return None
    trainer.save_full(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        saved = load_file(str(path))
    else:
        saved = torch.load(path)
    state = trainer.state_dict()
    return {"names": sorted(saved), "state_dict_names": sorted(state), "equal": all(
        torch.equal(saved[k], v) for k, v in state.items() if k in saved), "ref_err": err(saved, ref_params)}


def checkpoints(model, batches, root: Path) -> dict:
    """Save on 2x2 Megatron after 2 steps; load into other plans; continue as the uninterrupted run.
    Export it in full; load a model-only checkpoint (no optimizer state) and one saved before the
    first step."""
    ref_losses, _, ref_params = reference(model, batches, LR)
    step2 = reference(model, batches[:2], LR)[2]
    source, losses = train(model, "megatron", batches, 2)
    path = root / "ckpt"
    source.save(path, extra={"step": 2})
    out = {"full": {"model_names": sorted(model.state_dict()),
                    "pt": full_export(source, root / "ckpt_full.pt", step2),
                    "safetensors": full_export(source, root / "ckpt_full.safetensors", step2)}}
    out["source"] = {"losses": losses + [source.step(*b) for b in batches[2:]], "ref_losses": ref_losses}
    for plan in ("dp_1x4", "pipeline", "pipeline_4x1", "auto", "interleaved"):
        trainer, _ = train(model, plan, batches, 0, seed=5)
        extra = trainer.load(path)
        out[plan] = {"losses": [trainer.step(*b) for b in batches[2:]], "extra": extra,
                     "param_err": err(trainer.state_dict(), ref_params)}
    # into ZeRO-2 (the Adam states of its slices) and, after one more step, out of it again
    trainer, _ = train(model, "zero2", batches, 0, seed=5)
    trainer.load(path)
    losses = [trainer.step(*batches[2])]
    trainer.save(root / "ckpt_zero2", extra={"step": 3})
    again, _ = train(model, "dp_1x4", batches, 0, seed=6)
    # a checkpoint saved before the first step (no optimizer state yet) loads silently
    unstepped, _ = train(model, "pipeline", batches, 0)
    unstepped.save(root / "ckpt_step0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load(root / "ckpt_step0")
    out["step0"] = {"warnings": [str(w.message) for w in caught], "state": len(again.optimizer.state),
                    "param_err": err(again.state_dict(), model.state_dict())}
    again.load(root / "ckpt_zero2")
    out["zero2"] = {"losses": losses + [again.step(*batches[3])], "extra": {"step": 2},
                    "param_err": err(again.state_dict(), ref_params)}
    # one process resumed with the parameters but a fresh AdamW: what a lost optimizer state changes
    m = copy.deepcopy(model)
    m.load_state_dict(step2, strict=False)
    fresh_losses, _, fresh_params = reference(m, batches[2:], LR)
    out["fresh_optimizer"] = {"losses": fresh_losses, "param_err": err(fresh_params, ref_params)}
    # a model-only checkpoint (another program's dcp.save of the step-2 parameters): loaded with a
    # warning, fresh AdamW states: the run continues as the one-process fresh-optimizer resume
    dcp.save({f"model.{k}": v for k, v in m.state_dict().items()},
             storage_writer=dcp.FileSystemWriter(root / "c_model"))
    trainer, _ = train(model, "megatron", batches, 0, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.load(root / "c_model")
    out["model_only"] = {"warnings": [str(w.message) for w in caught], "state": len(trainer.optimizer.state),
                         "losses": [trainer.step(*b) for b in batches[2:]],
                         "param_err": err(trainer.state_dict(), fresh_params)}
    out["lr"] = lowered_learning_rate(model, batches, root)
    out["errors"] = checkpoint_errors(model, batches, source, path, root)
    return out


def lowered_learning_rate(model, batches, root: Path) -> dict:
    """A learning rate lowered after 2 steps (as a scheduler does), saved on 2x2 Megatron and
    loaded into DP on 1x4 with a fresh AdamW at ``LR``: the 2 steps after the resume run at the
    lowered rate, as one process whose rate was lowered after 2 steps."""
    source, _ = train(model, "megatron", batches, 2)
    for group in source.optimizer.param_groups:
        group["lr"] = LR / 4
    source.save(root / "ckpt_lr")
    trainer, _ = train(model, "dp_1x4", batches, 0, seed=5)
    trainer.load(root / "ckpt_lr")
    lrs = sorted({g["lr"] for g in trainer.optimizer.param_groups})
    losses = [trainer.step(*b) for b in batches[2:]]
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    for i, batch in enumerate(batches):
        if i == 2:
            for group in opt.param_groups:
                group["lr"] = LR / 4
        opt.zero_grad()
        m(*batch).backward()
        opt.step()
    want = {k: v.detach() for k, v in m.named_parameters(remove_duplicate=False)}
    return {"lrs": lrs, "losses": losses, "param_err": err(trainer.state_dict(), want),
            "unlowered_err": err(reference(model, batches, LR)[2], want)}


def fp16_resume(model, batches, root: Path) -> dict:
    """fp16 data parallel on 2x2: the first step overflows at the initial loss scale 2^16 (skipped,
    scale halved). Saved after 2 steps and resumed (another seed), the run continues as the
    uninterrupted one: the scaler's state is in the checkpoint (before, the resumed run restarted
    at 2^16, overflowed again at step 3 and skipped its update: last loss 3.5e-2 off, parameters
    2.7e-2)."""
    options = {"force_data_parallel": True, "mixed_precision": "fp16"}

    def make(seed):
        return parallelize(copy.deepcopy(model), (2, 2), batches[0], optimizer=adamw, seed=seed, **options)
    whole = make(0)
    losses = [whole.step(*b) for b in batches]
    first = make(0)
    resumed = [first.step(*b) for b in batches[:2]]
    first.save(root / "ckpt_fp16")
    second = make(3)
    second.load(root / "ckpt_fp16")
    scale = second.scaler.scale
    resumed += [second.step(*b) for b in batches[2:]]
    return {"losses": losses, "resumed": resumed, "skipped": whole.scaler.skipped, "saved_scale": first.scaler.scale,
            "loaded_scale": scale, "param_err": err(second.state_dict(), whole.state_dict())}


def dropout_resume(batches, root: Path) -> dict:
    """GPT with dropout 0.1 (attention and residual) under Megatron and ZeRO-3 on 2x2, a 2-stage
    pipeline of 2 devices per stage (2 microbatches) and interleaved 1F1B (2 stages per rank):
    saved after 2 steps and resumed by a trainer built
    with another seed, the run continues as the uninterrupted one (the random ops' stream is in
    the checkpoint; before, the resumed steps drew the first steps' dropout masks again: losses
    up to 1.9e-3 relative and parameters 2.8e-2 off the uninterrupted run's, with no error)."""
    model, _ = build_model("gpt-tiny", BATCH, SEQ, device="cpu", dropout=0.1)
    out = {}
    for plan in ("megatron", "zero3", "pipeline", "interleaved"):  # interleaved: 2 executors (chunks) per rank
        mesh, options = PLANS[plan]

        def make(seed, planned=None):
            return parallelize(copy.deepcopy(model), mesh, batches[0], optimizer=adamw, seed=seed,
                               **({"plan": planned} if planned is not None else options))
        whole = make(0)
        losses = [whole.step(*b) for b in batches]
        first = make(0, whole.plan)
        resumed = [first.step(*b) for b in batches[:2]]
        first.save(root / f"ckpt_dropout_{plan}")
        second = make(3, whole.plan)
        second.load(root / f"ckpt_dropout_{plan}")
        resumed += [second.step(*b) for b in batches[2:]]
        fresh = make(0, whole.plan)  # the masks of the first steps: what a lost stream repeats
        out[plan] = {"losses": losses, "resumed": resumed, "repeated": [fresh.step(*b) for b in batches[2:]],
                     "param_err": err(second.state_dict(), whole.state_dict())}
    return out


def resumed_on_fewer_ranks(model, batches, root: Path) -> dict:
    """Load the checkpoint the 4-rank launch saved on 2x2 Megatron after 2 steps into plans of
    this launch's 2 ranks (another world size); continue as the uninterrupted run."""
    ref_losses, _, ref_params = reference(model, batches, LR)
    out = {"ref_losses": ref_losses[2:]}
    for plan in ("dp_1x2", "auto_1x2"):
        trainer, _ = train(model, plan, batches, 0, seed=5)
        extra = trainer.load(root / "ckpt")
        out[plan] = {"losses": [trainer.step(*b) for b in batches[2:]], "extra": extra,
                     "param_err": err(trainer.state_dict(), ref_params)}
    return out


def checkpoint_errors(model, batches, source, path: Path, root: Path) -> dict:
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except (CheckpointError, torch.distributed.checkpoint.CheckpointException, OSError) as e:
            errors[name] = f"{type(e).__name__}: {e}"

    # a save that fails on one rank leaves the checkpoint there as it was, and no temporary directory
    before = {f.name: f.read_bytes() for f in sorted(path.iterdir())}
    writer = torch.distributed.checkpoint.FileSystemWriter
    original = writer.write_data
    if dist.get_rank() == 1:
        def broken(self, plan, planner):
            raise OSError("disk full (injected)")
        writer.write_data = broken
    attempt("failed_save", lambda: source.save(path))
    writer.write_data = original
    dist.barrier()
    errors["unchanged"] = before == {f.name: f.read_bytes() for f in sorted(path.iterdir())}
    errors["leftovers"] = sorted(f.name for f in root.iterdir() if not f.name.startswith(("ckpt", "c_")))
    # corrupt copies: a shard file missing, a truncated file, no .metadata, another model's checkpoint
    import shutil
    if dist.get_rank() == 0:
        for name in ("c_missing", "c_short", "c_nometa"):
            shutil.copytree(path, root / name)
        (root / "c_missing" / "__3_0.distcp").unlink()
        f = root / "c_short" / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:100])
        (root / "c_nometa" / ".metadata").unlink()
    dist.barrier()
    for name in ("c_missing", "c_short", "c_nometa"):
        attempt(name, lambda: source.load(root / name))
    other, example = build_model("mlp", BATCH, device="cpu")
    attempt("other_model", lambda: parallelize(other, (2, 2), example, force_data_parallel=True).load(path))
    # a parameter only the second stage holds is missing: ranks 2-3 fail their check, and ranks 0-1
    # (whose parameters are all there) raise too, at once, naming rank 2 (before: they waited in
    # dcp.load's collectives for the job's timeout and reported that)
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items() if k != "blocks.1.ffn.proj.weight"},
             storage_writer=dcp.FileSystemWriter(root / "c_stage1"))
    pipe, _ = train(model, "pipeline", batches, 0)
    start = time.monotonic()
    attempt("stage_missing", lambda: pipe.load(root / "c_stage1"))
    errors["stage_missing_seconds"] = time.monotonic() - start
    # an optimizer state a checkpoint cannot hold (not shaped like its parameter) on rank 2 only: every
    # rank raises at once, rank 0 naming rank 2 (before: the others waited in the save's collectives)
    if dist.get_rank() == 2:
        pipe.optimizer.state[next(iter(pipe.params.values()))]["factored"] = torch.zeros(3)
    start = time.monotonic()
    attempt("save_one_rank", lambda: pipe.save(root / "c_one_rank"))
    errors["save_one_rank_seconds"] = time.monotonic() - start
    return errors


def _named_groups(m, optimizer="adamw"):
    """HF's / nanoGPT's optimizer groups by name, from the model's own parameters: no weight
    decay for biases and norms."""
    named = dict(m.named_parameters())
    plain = [p for n, p in named.items() if n.endswith("bias") or ".ln" in n or n.startswith("ln")]
    decay = [p for n, p in named.items() if all(p is not q for q in plain)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]
    if optimizer == "adagrad":  # state made when built (its ``sum``), shaped like the whole parameter
        return torch.optim.Adagrad(groups, lr=LR, initial_accumulator_value=0.1)
    return torch.optim.AdamW(groups, lr=LR)


def named_groups(model, batches) -> dict:
    """An optimizer factory that builds its groups from ``model.named_parameters()`` (not from the
    shards it is given) trains as one process with the same groups (before: the optimizer held the
    model's own tensors, which no gradient reaches, and nothing trained: every loss the first)."""
    out = {}
    for plan, optimizer in (("megatron", "adamw"), ("zero2", "adamw"), ("zero3", "adamw"), ("pipeline", "adamw"),
                            ("2d", "adagrad"), ("zero1", "adagrad")):
        m = copy.deepcopy(model)
        ref = copy.deepcopy(model)
        opt = _named_groups(ref, optimizer)
        ref_losses = []
        for b in batches:
            opt.zero_grad()
            loss = ref(*b)
            loss.backward()
            opt.step()
            ref_losses.append(float(loss))
        mesh, options = PLANS[plan]
        trainer = parallelize(m, mesh, batches[0], optimizer=lambda _, m=m, o=optimizer: _named_groups(m, o),
                              **options)
        out[f"{plan}_{optimizer}"] = {"losses": [trainer.step(*b) for b in batches], "ref_losses": ref_losses,
                                      "param_err": err(trainer.state_dict(), dict(ref.named_parameters()))}
    bad = copy.deepcopy(model)
    try:
        parallelize(copy.deepcopy(model), (2, 2), batches[0], force_data_parallel=True,
                    optimizer=lambda _: torch.optim.SGD(bad.parameters(), lr=LR))
        out["foreign"] = "no error"
    except ValueError as e:
        out["foreign"] = str(e)
    return out


def timeouts(model, batches) -> dict:
    """The collective timeouts (seconds) of the default group and of a trainer's groups: the
    job's (``init_distributed(60)``) when ``parallelize`` is given none, for SPMD and pipeline
    trainers alike, then ``timeout_s=45`` for both."""
    def seconds(trainer):
        groups = {*trainer.groups.groups, trainer.groups.flat, dist.group.WORLD}
        return sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups})

    out = {}
    for given in (None, 45):
        for plan in ("dp", "pipeline"):
            trainer = parallelize(copy.deepcopy(model), PLANS[plan][0], batches[0], timeout_s=given, **PLANS[plan][1])
            out[f"{plan}-{given}"] = seconds(trainer)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--resume", action="store_true", help="2 ranks: load the 4-rank launch's checkpoint")
    args = ap.parse_args()
    init_distributed(60)
    model, _ = build_model("gpt-tiny", BATCH, SEQ, device="cpu")
    batches = make_batches()
    if args.resume:
        return finish(resumed_on_fewer_ranks(model, batches, Path(args.dir)), args.out)
    results = {"accumulation_and_clipping": accumulation_and_clipping(model, batches),
               "checkpoints": checkpoints(model, batches, Path(args.dir)), "timeouts": timeouts(model, batches),
               "named_groups": named_groups(model, batches), "fp16": fp16_resume(model, batches, Path(args.dir)),
               "dropout": dropout_resume(batches, Path(args.dir))}
    finish(results, args.out)


if __name__ == "__main__":
    main()
