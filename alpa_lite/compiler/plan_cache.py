"""A plan cache on disk: ILP answers kept between planning runs (re-plan; docs/planner.md).

Planning the same model again (another schedule, stage count, microbatch count at the same
batch, a rank that plans what another already planned) asks the same ILPs again. The cache keeps
their answers in a directory, one file per key family: ``PlanCache.file(kind, *parts)`` names a
family by a hash of ``parts`` (everything the answers depend on besides the per-ILP key), and
the file maps each ILP key to its answer.

- ``stage`` families (``stage_costs.GraphStageCosts``): parts = the microbatch graph's
  fingerprint (ops and shapes), the ``ClusterSpec`` (figures, devices per node: every logical
  mesh the stages use), the ``PlanOptions``, the memory budget and the gradient-sync weight
  ``1 / B``; keys = (ILP key: layer signature, incoming specs, logical mesh; activation scale;
  budget). Only an answer to the same ILP is returned, so a plan made with the cache is the plan
  made without it.
- ``intra`` families (``intra_op.plan_intra_op``): parts = a hash of the whole cost graph (costs,
  memory, edges, moves, remat groups), the budget, solver, time limit and switches; one key.

- ``graph`` families (``capture_cached``): parts = ``core.capture.capture_key`` (the model's
  structure and code, the call's shapes past the batch dim, the capture options, the torch
  version); one entry: the captured graph for any batch size (``AnyBatchGraph``), or why the
  model has none. A plan at another batch, or another microbatch count of a pipeline, gets its
  graph from it without torch.export.

A batch size or sequence length that changes the microbatch's shapes changes the fingerprint
and every layer signature, and another ``B`` at the same batch changes the microbatch rows: such
a re-plan reads no ILP answer (an answer of another ILP is never returned), only the graph.

Files are pickles ``{"version", "parts", "digest", "entries"}`` (the entries pickled, and their
sha256) written to a temporary name and renamed
(a reader never sees half a file; of two writers the last wins, each file whole). A file that
cannot be read, has another version or parts, or entries whose sha256 differs, is ignored with a
warning and rebuilt. Pickles
run code when loaded: point the cache only at a directory you trust.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import warnings
from pathlib import Path

from ..core.capture import AnyBatchGraph, CaptureError, CapturedGraph, batch_size, capture, capture_any_batch, capture_key

VERSION = 14  # 2: stage ILPs offer ZeRO-1/2 (their answers of version 1 are of other ILPs); 3: answers name the
# layers recomputed (remat="auto" in stages); 4: answers carry the solver limits they reached; 5: stage ILPs
# price what backward hides (ilp.Pool) and stage times leave the optimizer update out of backward; 6: entries stored
# with their sha256; 7: a stage's optimizer update is paid once per step (in once_seconds, weighed 1 / B in its
# ILP); 8: stage ILPs price ZeRO-3 latencies per group (ilp.Pool.grouped); 9: a lookup-only weight's gradient
# is bucketed (CapturedGraph.param_lookups); 10: one ILP over every layer using a tied weight may put it in ZeRO-1/2;
# 11: plans mark the loss all-reduce the SPMD runtime defers (Collective.deferred), hidden behind backward
# 12: a sum over both mesh axes is one all-reduce over the whole mesh (listed once, deferred as a loss);
# 13: a pipeline's last stage defers its loss's all-reduce too (its ILP and listing price it hidden); 14: blocks
# numbered inside numbered blocks share ILP variables (a Wide-ResNet's stages.i.j: other ILPs, other answers)


class CacheFile:
    """The answers of one key family: ``get(key)`` (None when absent), ``put(key, answer)``,
    ``save()`` (merges what this run added into the file on disk)."""

    def __init__(self, path: Path, parts: bytes):
        self.path, self.parts = path, parts
        self.entries = self._read()
        self.new: dict = {}

    def _read(self, warn: bool = True) -> dict:
        """The file's entries; {} for a missing file, and for an unreadable one (with a warning
        when ``warn``): another version, other inputs, or entries whose sha256 is not the one
        written with them (a corrupt file that would still unpickle)."""
        if not self.path.exists():
            return {}
        try:
            data = pickle.loads(self.path.read_bytes())
            if data["version"] != VERSION or data["parts"] != self.parts:
                raise ValueError(f"version {data['version']}, written for other inputs")
            if hashlib.sha256(data["entries"]).hexdigest() != data["digest"]:
                raise ValueError("its entries are not the ones written (sha256 differs)")
            return dict(pickle.loads(data["entries"]))
        except Exception as e:  # noqa: BLE001 - any unreadable file is rebuilt
            if warn:
                warnings.warn(f"plan cache file {self.path} ignored and rebuilt: {type(e).__name__}: {e}", stacklevel=3)
            return {}

    def get(self, key):
        return self.entries.get(key)

    def put(self, key, answer) -> None:
        self.entries[key] = self.new[key] = answer

    def save(self) -> None:
        if not self.new:
            return
        entries = self._read(warn=False) | self.new  # another run may have added answers meanwhile
        blob = pickle.dumps(entries, protocol=4)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump({"version": VERSION, "parts": self.parts, "digest": hashlib.sha256(blob).hexdigest(),
                         "entries": blob}, f)
        os.replace(tmp, self.path)
        self.new = {}


class PlanCache:
    """A cache directory (created when missing).

    Raises:
        ValueError: ``directory`` exists and is not a directory, or cannot be created.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.graph_hits = 0  # captures answered from the cache (``capture_cached``)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"plan cache {self.directory} is not a directory: give a directory (created if missing)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a parent is a file, no permission ...
            raise ValueError(f"plan cache {self.directory} cannot be created: {e.strerror}") from e

    def file(self, kind: str, *parts) -> CacheFile:
        """The family ``kind`` of answers that depend on ``parts`` (picklable values)."""
        blob = pickle.dumps(parts, protocol=4)
        return CacheFile(self.directory / f"{kind}-{hashlib.sha256(blob).hexdigest()[:24]}.pkl", blob)


def solve_cached(cache: PlanCache | None, graph, budget: float, solve, **solver_args) -> tuple:
    """``(solve(graph, budget, **solver_args), False)``, or ``(its answer from an earlier run on
    cache, True)``."""
    if cache is None:
        return solve(graph, budget, **solver_args), False
    family = cache.file("intra", hashlib.sha256(pickle.dumps(graph, protocol=4)).hexdigest(), budget,
                        sorted(solver_args.items()))
    answer = family.get("solution")
    if answer is not None:
        return answer, True
    answer = solve(graph, budget, **solver_args)
    family.put("solution", answer)
    family.save()
    return answer, False


def capture_cached(cache: PlanCache | None, model, example_inputs: tuple, loss_fn, targets: tuple, example_kwargs,
                   compute_dtype) -> CapturedGraph:
    """``core.capture.capture(model, example_inputs, loss_fn, targets, example_kwargs,
    compute_dtype)``, without torch.export when ``cache`` keeps this model's graph for any batch
    size (``AnyBatchGraph.at``, node for node the same graph; ``cache.graph_hits`` counts them).
    The first capture of a model on a cache also exports it for any batch size
    (``capture_any_batch``, checked against the graph captured) and keeps that graph, or why
    there is none (the model specializes on the batch ...): later plans of it then capture
    afresh, as without a cache.

    Raises:
        CaptureError: as ``capture``.
    """
    call = (model, example_inputs, loss_fn, targets, example_kwargs, compute_dtype)
    key = capture_key(*call) if cache is not None else None
    if key is None:
        return capture(*call)
    family = cache.file("graph", *key)
    kept = family.get("any-batch")
    batch = batch_size(((example_inputs, targets), example_kwargs))
    if isinstance(kept, AnyBatchGraph) and kept.batches[0] <= batch <= kept.batches[1]:
        cache.graph_hits += 1
        return kept.at(batch)
    cg = capture(*call)
    if kept is None:
        try:
            kept = capture_any_batch(*call, fresh=cg)
        except CaptureError as e:
            kept = str(e)  # the reason: kept, so that later plans do not export again
        family.put("any-batch", kept)
        family.save()
    return cg
