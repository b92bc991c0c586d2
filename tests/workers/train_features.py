"""Run on every rank by torchrun: gradient accumulation, global-norm clipping and sharded
checkpoints (resumed under other plans) vs one process on the same batches. Rank 0 writes one
JSON record per case.

The model is the built-in GPT (tied embedding, token-mean cross-entropy) with some targets set to
``ignore_index`` (-100), a different count per row, and none valid in rows 0-1 of the first
batch: a microbatch of 2 rows then has no valid target at all.
"""
import argparse
import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist

from alpa_lite import parallelize
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


def accumulation_and_clipping(model, batches) -> dict:
    """K microbatches, one update: the whole batch's loss, gradients and parameters; the global
    norms (2 and inf) of their gradients equal one process's. ``max_grad_norm`` on the other
    plans: the norm before clipping and the clipped SGD run equal one process's."""
    ref_losses, ref_grads, ref_params = reference(model, batches[:2], LR)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    norms, _ = reference_sgd(model, batches[:1], math.inf)
    out = {"ref_norm": norms[0], "ref_inf": scale}
    for plan, k in (("megatron", 4), ("dp", 2)):
        trainer = parallelize(copy.deepcopy(model), PLANS[plan][0], batches[0], optimizer=adamw, accumulate=k,
                              **PLANS[plan][1])
        losses = [trainer.step(*batches[0])]
        grads = trainer.gradients()
        norm, inf = float(trainer.grad_norm()), float(trainer.grad_norm(math.inf))
        losses.append(trainer.step(*batches[1]))
        out[f"{plan}_k{k}"] = {"losses": losses, "ref_losses": ref_losses, "grad_err": err(grads, ref_grads) / scale,
                               "param_err": err(trainer.state_dict(), ref_params), "norm": norm, "inf": inf,
                               "same": same_on_every_rank(norm),
                               "micro_rows": int(trainer.cg.node(trainer.cg.input_names[0]).meta["val"].shape[0])}
    max_norm = norms[0] / 3
    ref_norms, ref_clipped = reference_sgd(model, batches[:2], max_norm)
    out["unclipped_move"] = err(reference_sgd(model, batches[:2], math.inf)[1], ref_clipped)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731 - SGD: a clipped step moves by less
    for plan in ("2d", "zero3", "zero2", "zero1", "pipeline"):
        trainer, _ = train(model, plan, batches, 1, optimizer=sgd, max_grad_norm=max_norm)
        first = trainer.last_grad_norm
        trainer.step(*batches[1])
        out[f"clipped_{plan}"] = {"norm": first, "same": same_on_every_rank(first),
                                  "param_err": err(trainer.state_dict(), ref_clipped)}
    return out


def checkpoints(model, batches, root: Path) -> dict:
    """Save on 2x2 Megatron after 2 steps; load into other plans; continue as the uninterrupted run."""
    ref_losses, _, ref_params = reference(model, batches, LR)
    source, losses = train(model, "megatron", batches, 2)
    path = root / "ckpt"
    source.save(path, extra={"step": 2})
    out = {"source": {"losses": losses + [source.step(*b) for b in batches[2:]], "ref_losses": ref_losses}}
    for plan in ("dp_1x4", "pipeline", "auto"):
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
    again.load(root / "ckpt_zero2")
    out["zero2"] = {"losses": losses + [again.step(*batches[3])], "extra": {"step": 2},
                    "param_err": err(again.state_dict(), ref_params)}
    # one process resumed with the parameters but a fresh AdamW: what a lost optimizer state changes
    m = copy.deepcopy(model)
    m.load_state_dict(reference(model, batches[:2], LR)[2], strict=False)
    fresh_losses, _, fresh_params = reference(m, batches[2:], LR)
    out["fresh_optimizer"] = {"losses": fresh_losses, "param_err": err(fresh_params, ref_params)}
    out["errors"] = checkpoint_errors(batches, source, path, root)
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


def checkpoint_errors(batches, source, path: Path, root: Path) -> dict:
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
    return errors


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
               "checkpoints": checkpoints(model, batches, Path(args.dir))}
    finish(results, args.out)


if __name__ == "__main__":
    main()
