"""Checkpoints of a trainer: sharded, with ``torch.distributed.checkpoint`` (DCP), readable under
any plan; and a full export for inference.

``save(trainer, path)``: every rank hands DCP its shards as DTensors on the mesh they live on
(the plan's ``DeviceMesh``; a pipeline stage's own submesh) with the plan's placements
(``ShardingSpec.placements``): the parameters and buffers under ``model.<fqn>``, and every
optimizer state shaped like its parameter (Adam's moments, SGD's momentum) under
``optim.state.<fqn>.<name>`` with the same placements (scalars such as Adam's ``step`` as plain
tensors; the states of a ZeRO-1/2 parameter's slice are all-gathered over its zero axes into the
shape of its shard first, and sliced again on load, so a checkpoint does not depend on ZeRO).
DCP writes each rank's chunks in parallel, a replicated chunk once, and records each tensor's
global shape and chunk offsets in ``.metadata``; nothing is gathered onto one rank. The checkpoint
goes to a temporary directory beside ``path`` that replaces ``path`` only once complete, so a
failed save leaves what was there.

``load(trainer, path)``: every rank asks DCP for its own shards under its own plan (another mesh
shape, sharding, world size, or a pipelined plan); DCP reads the overlapping chunks of the saved
ones. A weight several pipeline stages hold is saved by the first and read by all. The
hyperparameters of each parameter's optimizer group (``lr``, ``betas``, ``weight_decay`` ...) are
saved under ``optim.group.<fqn>.<name>`` and set again on load in the group now holding the
parameter (from its first member with saved values), as ``torch.optim.Optimizer.load_state_dict``
restores its ``param_groups``: a learning rate a scheduler lowered resumes lowered (before, the
new optimizer's rate ran the first step after a resume, and a scheduler's ``load_state_dict``
does not write the rate back).
Every checkpoint ``save`` writes holds the scalar ``optim.complete`` (``COMPLETE``): its optimizer
states are all the saving optimizer had, so a parameter without any (saved before its first
update, or by a stateless optimizer such as plain SGD) starts with a fresh state, silently. A
checkpoint without it (a model-only one, written by another program with ``dcp.save`` of
``model.<fqn>`` tensors) loads too: the parameters it has no optimizer state for start with a
fresh one (as on a first step), and ``load`` warns, naming the first one's missing
``optim.state.<fqn>.*`` key.

Under fp16 the loss scaler's state (its scale, clean steps since the last change, steps skipped;
``precision.LossScaler``) is saved as ``scaler.*`` scalars and restored by a trainer that has a
scaler: before (sweep 9), a resumed fp16 run restarted at the initial 2^16 and overflowed again,
skipping a batch the uninterrupted run had trained on.

The random ops' stream (dropout masks; ``LocalExecutor.shard_seed``: the run's seed and its
count of runs, the same on every rank at a step's end) is saved as ``rng.stream`` and restored,
as a checkpoint restores torch's random state elsewhere: a resumed run draws the masks the
uninterrupted one would have (before, its count restarted at 0, and the steps after a resume
repeated the first steps' masks, with no error; the seed a resumed trainer was built with is
replaced by the saved one).

``save_full(trainer, path)``: the full state dict (``Trainer.state_dict``) on rank 0, as
safetensors for a ``.safetensors`` path, else ``torch.save``; also written to a temporary name
and renamed.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

EXTRA = "extra.json"
COMPLETE = "optim.complete"
SCALER = {"scaler.scale": ("scale", torch.float64), "scaler.clean": ("_clean", torch.int64),
          "scaler.skipped": ("skipped", torch.int64)}
"""fp16's loss scaler (``precision.LossScaler``): checkpoint key -> (attribute, dtype)."""
RANDOM = "rng.stream"
"""The random ops' stream: int64 ``[seed, calls]`` of the trainer's executors (module docstring)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or does not fit the trainer's model."""


def _dtensor(trainer, fqn: str, local: torch.Tensor):
    """``local`` (a shard of ``fqn``, or a tensor shaped like one) as a DTensor with ``fqn``'s
    placements and global shape."""
    from torch.distributed.tensor import DTensor

    shape = trainer.global_shape(fqn)
    return DTensor.from_local(local, trainer.state_mesh(fqn), trainer.placements(fqn), run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _sharded_state(trainer) -> dict[str, object]:
    """The flat DCP state dict of this rank (module docstring)."""
    executor = trainer.executors()[0]  # every executor of every rank is at the same place of its stream
    state: dict[str, object] = {COMPLETE: torch.ones((), dtype=torch.int8),
                                RANDOM: torch.tensor([executor.seed, executor.calls], dtype=torch.int64)}
    if getattr(trainer, "scaler", None) is not None:  # the same on every rank
        state |= {key: torch.tensor(getattr(trainer.scaler, name), dtype=dtype) for key, (name, dtype) in SCALER.items()}
    for fqn, x in {**trainer.params, **trainer.buffers}.items():
        if trainer.owns(fqn):
            state[f"model.{fqn}"] = _dtensor(trainer, fqn, x.detach())
    if trainer.optimizer is None:
        return state
    for fqn, p in trainer.params.items():
        if not trainer.owns(fqn):
            continue
        zero = trainer.zero_of(fqn)
        for name, value in trainer.optimizer.state.get(zero.slices.get(fqn, p), {}).items():
            key = f"optim.state.{fqn}.{name}"
            if fqn in zero.slices and isinstance(value, torch.Tensor) and value.dim():
                value = zero.unslice(fqn, value)  # a ZeRO-1/2 slice's state, as its shard's
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                state[key] = _dtensor(trainer, fqn, value)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                state[key] = value
            elif isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {name!r} of {fqn} has shape {tuple(value.shape)}, not its "
                                      f"parameter shard's {tuple(p.shape)}: checkpoints hold optimizer states "
                                      "shaped like their parameter (Adam, SGD momentum ...) or scalars")
            else:
                state[key] = value
        held = zero.slices.get(fqn, p)
        group = next((g for g in trainer.optimizer.param_groups if any(t is held for t in g["params"])), {})
        for name, value in group.items():
            if name != "params":
                state[f"optim.group.{fqn}.{name}"] = value
    return state


def save(trainer, path: str | Path, extra: dict | None = None) -> None:
    """Write ``trainer``'s parameter, buffer and optimizer-state shards to the directory ``path``
    (module docstring); call on every rank. ``path`` must be on a file system every rank sees.

    Args:
        extra: JSON-able data saved with the checkpoint (a step count ...); ``load`` returns it.

    Raises:
        ValueError: ``path``'s parent directory does not exist, or ``extra`` is not JSON-able.
        CheckpointError: an optimizer state that is neither parameter-shaped nor a scalar; on
            the other ranks, when one rank's checks failed (the message names it).
        torch.distributed.checkpoint.CheckpointException: a rank failed to write (on every rank;
            ``path`` is left as it was).
    """
    path = Path(path).absolute()
    try:
        if not path.parent.is_dir():
            raise ValueError(f"cannot save to {path}: the directory {path.parent} does not exist")
        text = json.dumps(extra or {})  # fails here, on every rank, before anything is written
        state = _sharded_state(trainer)
        error = None
    except Exception as e:  # noqa: BLE001 - agreed on, then raised as it was
        error = e
    _agree(error, f"cannot save checkpoint {path}")
    box = [tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    try:
        if dist.get_rank() == 0:
            (tmp / EXTRA).write_text(text)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.get_rank() == 0:
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.replace(tmp, path)
    dist.barrier()


def _agree(error: Exception | None, what: str) -> None:
    """Raise on every rank when a rank's checks before DCP's collectives failed (``error``: this
    rank's, or None): the failing rank raises its own error, the others a ``CheckpointError``
    naming the first failing rank and its error. Each rank checks its own shards (a pipeline
    stage: its stage's), and one that failed alone left the others waiting in ``dcp.save`` /
    ``dcp.load`` (or the broadcast of the temporary directory) until the job's collective timeout."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    first = next((r for r, f in enumerate(failures) if f is not None), None)
    if first is not None:
        raise CheckpointError(f"{what}: rank {first} failed: {failures[first]}")


def _reader(path: Path):
    """A ``FileSystemReader`` of ``path`` and its metadata, after checking that every file the
    metadata names is there and long enough."""
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path} (not a directory)")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} has no .metadata file: it is not a complete checkpoint "
                              "(a save that did not finish?)")
    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - any unpickling error means the same
        raise CheckpointError(f"checkpoint {path}: .metadata is corrupt ({type(e).__name__}: {e})") from None
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(sizes.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: file {name} is missing")
        if f.stat().st_size < size:
            raise CheckpointError(f"checkpoint {path} is corrupt: file {name} has {f.stat().st_size} bytes, "
                                  f"its metadata says at least {size}")
    return reader, metadata


def load(trainer, path: str | Path) -> dict:
    """Read the checkpoint ``path`` (written by ``save`` under any plan) into ``trainer``'s shards
    and optimizer state; call on every rank.

    Returns:
        the ``extra`` dict given to ``save``.

    Warns:
        UserWarning: the checkpoint was not written by ``save`` and holds no optimizer state for
            some of this rank's parameters (the message names the first missing key): they are
            loaded, and their optimizer state is fresh (module docstring).

    Raises:
        CheckpointError: no checkpoint at ``path``; a file the metadata names is missing or too
            short; ``.metadata`` is corrupt; a parameter of the model is not in the checkpoint
            (the message names its key) or has another shape there (another model). Raised on
            every rank, also where the rank failing is another (a pipeline stage's parameter
            missing: the message names that rank); the failing rank raises its own error.
    """
    path = Path(path)
    try:
        reader, saved, target = _load_target(trainer, path)
        error = None
    except Exception as e:  # noqa: BLE001 - agreed on, then raised as it was
        error = e
    _agree(error, f"cannot load checkpoint {path}")
    try:
        dcp.load(target, storage_reader=reader)
    except Exception as e:  # noqa: BLE001 - DCP raises CheckpointException on every rank
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in target.items()}
    for key, (name, _) in SCALER.items():
        if key in local:
            setattr(trainer.scaler, name, local[key].item())
    if RANDOM in local:  # a checkpoint without it (written by another program): the stream goes on
        for executor in trainer.executors():
            executor.seed, executor.calls = local[RANDOM].tolist()
    with torch.no_grad():
        for fqn, x in {**trainer.params, **trainer.buffers}.items():
            if f"model.{fqn}" in local:
                x.copy_(local[f"model.{fqn}"])
    if trainer.optimizer is not None:
        if COMPLETE not in saved:
            missing = [f for f in trainer.params if not any(k.startswith(f"optim.state.{f}.") for k in saved)]
            if missing:
                warnings.warn(f"checkpoint {path} was not written by Trainer.save and has no optimizer state for "
                              f"{len(missing)} of this rank's {len(trainer.params)} parameters (no "
                              f"'optim.state.{missing[0]}.*'): they start with a fresh optimizer state", stacklevel=3)
        _load_optimizer(trainer, local)
    extra = path / EXTRA
    return json.loads(extra.read_text()) if extra.is_file() else {}


def _load_target(trainer, path: Path):
    """``(reader, saved metadata by key, target)`` of ``load``: the DCP state dict of this
    rank's shards to read, after checking the checkpoint's files and the keys and shapes of this
    rank's parameters."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader, metadata = _reader(path)
    saved = metadata.state_dict_metadata
    target: dict[str, object] = {}
    if getattr(trainer, "scaler", None) is not None:  # a checkpoint without them: the scaler starts fresh
        target |= {key: torch.empty((), dtype=dtype) for key, (_, dtype) in SCALER.items() if key in saved}
    if RANDOM in saved:
        target[RANDOM] = torch.empty(2, dtype=torch.int64)
    for fqn, x in {**trainer.params, **trainer.buffers}.items():
        key = f"model.{fqn}"
        if key not in saved:
            if fqn in trainer.buffers:  # a buffer missing keeps its value (non-persistent buffers)
                continue
            raise CheckpointError(f"checkpoint {path} has no {key!r}: it is not a checkpoint of this model")
        if tuple(saved[key].size) != trainer.global_shape(fqn):
            raise CheckpointError(f"checkpoint {path}: {key!r} has shape {tuple(saved[key].size)}, the model's is "
                                  f"{trainer.global_shape(fqn)}")
        target[key] = _dtensor(trainer, fqn, torch.empty_like(x.detach()))
    if trainer.optimizer is not None:
        for fqn, p in trainer.params.items():
            prefixes = (f"optim.state.{fqn}.", f"optim.group.{fqn}.")
            for key, m in saved.items():
                prefix = next((x for x in prefixes if key.startswith(x)), None)
                if prefix is None or "." in key[len(prefix):]:
                    continue
                if not isinstance(m, TensorStorageMetadata):
                    target[key] = None
                elif tuple(m.size) == trainer.global_shape(fqn):
                    target[key] = _dtensor(trainer, fqn, torch.empty_like(p.detach(), dtype=m.properties.dtype))
                else:
                    target[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype, device=p.device)
    return reader, saved, target


def _load_optimizer(trainer, local: dict[str, object]) -> None:
    """Set the optimizer state of every parameter from the loaded ``optim.state.<fqn>.<name>``,
    and each group's hyperparameters from ``optim.group.<fqn>.<name>`` of its first member that
    has them (module docstring)."""
    def entries(kind: str, fqn: str) -> dict[str, object]:
        prefix = f"optim.{kind}.{fqn}."
        return {k[len(prefix):]: v for k, v in local.items() if k.startswith(prefix) and "." not in k[len(prefix):]}

    state_dict = trainer.optimizer.state_dict()
    order = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    state, settings = {}, {}
    for fqn, p in trainer.params.items():
        zero = trainer.zero_of(fqn)
        entry = entries("state", fqn)
        if fqn in zero.slices:  # a ZeRO-1/2 parameter: the optimizer holds its slice
            p = zero.slices[fqn]
            entry = {k: zero.slice(fqn, v) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in entry.items()}
        if entry and id(p) in index:
            state[index[id(p)]] = entry
        settings.setdefault(id(p), entries("group", fqn))
    trainer.optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
    for group in trainer.optimizer.param_groups:
        saved = next((settings[id(p)] for p in group["params"] if settings.get(id(p))), {})
        group.update((name, value) for name, value in saved.items() if name in group)


def save_full(trainer, path: str | Path) -> None:
    """Write the full (gathered) parameters and buffers by FQN, tied names included, to the file
    ``path`` from rank 0: safetensors when ``path`` ends in ``.safetensors``, else ``torch.save``;
    call on every rank (it gathers, as ``state_dict`` does).

    Raises:
        ValueError: the directory of ``path`` does not exist.
        ImportError: a ``.safetensors`` path without the safetensors package.
        OSError: rank 0 could not write (on every rank; ``path`` is left as it was).
    """
    path = Path(path).absolute()
    if not path.parent.is_dir():
        raise ValueError(f"cannot save to {path}: the directory {path.parent} does not exist")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError("a .safetensors export needs the safetensors package (pip install safetensors); "
                              "or give a .pt path for torch.save") from None
    state = trainer.state_dict()
    box = [None]
    if dist.get_rank() == 0:
        tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
        try:
            if path.suffix == ".safetensors":
                save_file({k: v.contiguous().clone() for k, v in state.items()}, str(tmp))
            else:
                torch.save(state, tmp)
            os.replace(tmp, path)
        except OSError as e:
            box[0] = f"{type(e).__name__}: {e}"
        finally:
            tmp.unlink(missing_ok=True)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise OSError(f"saving {path} on rank 0 failed: {box[0]}")
