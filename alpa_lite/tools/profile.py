"""``alpa-lite profile``: measure a cluster and write a cluster JSON for the planner.

The parent process (:func:`run`) starts ``nproc`` ranks with :func:`alpa_lite.runtime.launch.torchrun`;
each rank runs this module with ``--worker``. For the logical mesh ``(n0, n1)`` over the ranks
(rank ``r`` sits at ``(r // n1, r % n1)``: axis-1 groups are the rows ``i*n1 .. i*n1+n1-1``,
axis-0 groups the columns) the workers measure:

- every collective (all-reduce, all-gather, reduce-scatter, all-to-all) on each mesh axis of
  size > 1, and on the whole world (``"01"``) when both axes are > 1, over a sweep of sizes
  ``B``. ``B`` means what the cost methods of :class:`~alpa_lite.core.mesh.LogicalMesh` mean: the
  all-reduced tensor, the all-gather result, the reduce-scatter input, the per-device
  all-to-all buffer. All groups of an axis run at once, as they would in an SPMD step. The
  calls are the ones the runtime issues (``runtime/collectives.run_step``: the list forms of
  ``all_gather``, ``reduce_scatter`` and ``all_to_all``; on gloo a list ``reduce_scatter`` costs
  more than an all-reduce of the same input, so the tensor forms would mislead the planner).
  Each point: warm-up calls, then ``repeats`` timings, each after a world barrier, of one call
  (or of a batch of up to 10 back-to-back calls, divided by their count, for messages below a
  quarter of the largest size, as nccl-tests does); a rank's figure is its median, the point is
  the maximum over ranks. A curve whose times do not grow with the size (a busy machine
  delayed its small messages, so no alpha-beta line fits) is measured again with 2x, then 4x
  the repeats before the profile gives up on it;
- send/recv between rank 0 and the last rank (ping-pong, half the round trip);
- one device's matmul FLOP/s (``2 n^3`` FLOPs per ``n x n`` matmul) in each dtype of
  :data:`MATMUL_DTYPES` (``peak_flops`` is the one of ``--dtype``, the dtype the model trains in;
  every dtype's figure is kept under ``measurements["compute"]["matmul_flops"]``; ``--dtype``'s at
  ``n = --matmul-n``, another at the largest ``n`` up to it, halving, whose call takes under
  ``SEGMENT_SECONDS``, so a dtype without a fast kernel costs seconds, not minutes; the sizes
  are under ``"matmul_sizes"``) and memory bandwidth
  (a large tensor copy moves ``2 x`` its bytes: read + write) as an SPMD step sees them: every
  rank runs the same segment of back-to-back calls (about ``SEGMENT_SECONDS`` long) between two
  world barriers, so the segment lasts until the slowest rank is done, as a compute segment
  between two collectives of a training step does; a call's time is the segment's over its
  calls, the fastest of ``SEGMENTS`` (other processes on a shared machine only ever add time;
  ``benchmarks/cost_fidelity.py`` compares with the fastest step likewise). On ranks that share
  CPU cores this includes the stragglers that the scheduler makes; a single call per rank would
  be dominated by noise;
- the same way, the FLOP/s of the kernel classes that run far below the matmul peak
  (:data:`alpa_lite.core.mesh.KERNEL_CLASSES`): causal scaled-dot-product attention and a GELU, each
  forward plus backward, in ``--dtype`` (``kernel_flops`` of the cluster file);

With one rank (``--nproc 1``) or ``--compute-only`` only the compute figures are measured: the
cluster file is the ``--base`` cluster (a preset or a cluster JSON: its node layout, links and any
measured collectives) with this device's ``peak_flops``, ``mem_bandwidth``, ``memory_bytes`` and
``kernel_flops``, so one GPU (or one CPU process) calibrates the compute side of a cluster whose
network it cannot measure; ``measurements["network_from"]`` names the base.

Each curve is fitted by :func:`fit_alpha_beta` to the alpha-beta model of
:mod:`alpa_lite.core.mesh` (Thakur et al., IJHPCA 2005; Alpa, OSDI'22, section 4.2). Rank 0 writes a
:class:`~alpa_lite.core.mesh.ClusterSpec` whose ``mesh_links["n0xn1"]`` holds the per-axis all-reduce
fits, and a ``measurements`` section with every fit and raw curve; ``--use-curves`` makes the
planner interpolate those curves instead of the fits (``"use_curves": true``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from alpa_lite.core.mesh import COLLECTIVES, ClusterSpec, Link, bytes_factor, get_cluster, parse_mesh_shape

KiB, MiB, GiB = 2**10, 2**20, 2**30
CPU_SIZES = tuple(4 * KiB * 4**i for i in range(6))      # 4 KiB .. 4 MiB, x4 steps
CUDA_SIZES = tuple(256 * KiB * 4**i for i in range(7))   # 256 KiB .. 1 GiB, x4 steps
P2P = "send-recv"
SEGMENT_SECONDS, SEGMENTS = 0.15, 8  # lock-step compute segments per compute figure (see the docstring)
REMEASURES = 2  # a curve whose fit fails is measured again, with 2x, then 4x the repeats
MATMUL_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}


@dataclass(frozen=True)
class FitResult:
    """An alpha-beta fit ``t = alpha + beta * x`` of measured times.

    Attributes:
        alpha: latency, seconds (>= 0).
        beta: inverse bandwidth, seconds per effective byte (> 0); ``1 / beta`` is the
            "bus bandwidth" (bytes/s) in the sense of nccl-tests.
        residual: relative RMS error of the fit, ``sqrt(mean(((fit - t) / t)^2))``
            (0.05 = the line is typically 5 % off a measured point).
    """

    alpha: float
    beta: float
    residual: float

    @property
    def bandwidth(self) -> float:
        """``1 / beta``, bytes/s."""
        return 1.0 / self.beta

    def link(self) -> Link:
        return Link(self.alpha, self.beta)


def effective_bytes(kind: str, n: int, nbytes: float) -> float:
    """Bytes a device moves per unit ``beta`` in collective ``kind`` on ``n`` devices.

    ``2 (n-1)/n * B`` for all-reduce, ``(n-1)/n * B`` for all-gather, reduce-scatter and
    all-to-all (:func:`alpa_lite.core.mesh.bytes_factor`), ``B`` for send-recv.
    """
    return float(nbytes) if kind == P2P else bytes_factor(kind, n) * float(nbytes)


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], *, kind: str | None = None,
                   n: int | None = None, relative: bool = True) -> FitResult:
    """Least-squares fit of the alpha-beta model ``t = alpha + beta * x``.

    Args:
        nbytes: message sizes, bytes. With ``kind`` and ``n`` they are the collective's ``B``
            and ``x = effective_bytes(kind, n, B)``; without, ``x = nbytes`` as given.
        seconds: measured times, seconds, one per size.
        kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
            ``"send-recv"``; n: devices in the group.
        relative: weight each point by ``1 / t`` (``numpy.linalg.lstsq`` on the scaled rows),
            i.e. minimize relative rather than absolute error, so that a sweep over three
            orders of magnitude fits the small-message latency as well as the bandwidth.

    Returns:
        ``FitResult(alpha [s], beta [s/effective byte], residual [relative RMS])``. When the
        unconstrained fit has ``alpha < 0``, alpha is clipped to 0 and beta refitted through
        the origin (the constrained least-squares optimum).

    Raises:
        ValueError: on fewer than 2 distinct sizes, non-positive or non-finite times, or a
            fit with ``beta <= 0`` (times that do not grow with size).
    """
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if kind is not None:
        if n is None:
            raise ValueError("fit_alpha_beta: kind needs the group size n")
        x = np.array([effective_bytes(kind, n, b) for b in x])
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError(f"fit_alpha_beta: need equally many sizes and times, got {x.shape} and {t.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"fit_alpha_beta: need at least 2 distinct sizes, got {x.tolist()}")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(np.isfinite(x)) and np.all(x >= 0)):
        raise ValueError("fit_alpha_beta: times must be finite and > 0 s and sizes finite and >= 0 bytes")
    w = 1.0 / t if relative else np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([w, w * x], axis=1), w * t, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.dot(w * x, w * t) / np.dot(w * x, w * x))
    if not beta > 0:
        raise ValueError(f"fit_alpha_beta: the fitted beta is {beta:.3g} s/byte (<= 0): the times do not grow with "
                         "the size; widen the size sweep or raise the repeats")
    pred = alpha + beta * x
    residual = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return FitResult(float(alpha), float(beta), residual)


def mesh_groups(shape: tuple[int, int]) -> dict[str, list[list[int]]]:
    """The process groups of each measured axis: ``"1"`` rows, ``"0"`` columns, ``"01"`` all.

    Only axes of size > 1 appear; ``"01"`` only when both are > 1 (else it equals one axis).
    """
    n0, n1 = shape
    groups = {}
    if n0 > 1:
        groups["0"] = [[i * n1 + j for i in range(n0)] for j in range(n1)]
    if n1 > 1:
        groups["1"] = [[i * n1 + j for j in range(n1)] for i in range(n0)]
    if n0 > 1 and n1 > 1:
        groups["01"] = [list(range(n0 * n1))]
    return groups


def parse_size(text: str) -> int:
    """``"4K"``/``"4KiB"`` -> 4096, ``"1M"`` -> 1048576, ``"512"`` -> 512 (binary prefixes), bytes.

    Raises:
        ValueError: on anything else.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"size must look like 4096, 4K, 4KiB, 1M or 1G, got {text!r}")
    value = float(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": GiB}[m.group(2)]
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def _memory_bytes_total() -> float:
    """Physical memory of this machine, bytes (psutil when installed, else /proc/meminfo)."""
    try:
        import psutil

        return float(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# ----------------------------------------------------------------------------------- worker


class _Progress:
    """Rank 0 reports each finished step to a JSON file the parent polls."""

    def __init__(self, path: str | None, total: int, enabled: bool):
        self.path, self.total, self.done, self.enabled = path, total, 0, enabled and bool(path)

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            tmp = f"{self.path}.tmp"
            Path(tmp).write_text(json.dumps({"done": self.done, "total": self.total, "step": what}))
            os.replace(tmp, self.path)


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from alpa_lite.runtime.launch import init_distributed

    init_distributed(timeout_s=args.coll_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    n0, n1 = parse_mesh_shape(args.mesh)
    if n0 * n1 != world:
        raise ValueError(f"mesh {n0}x{n1} needs {n0 * n1} ranks, launched {world}")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = sorted(set(args.sizes)) if args.sizes else list(CUDA_SIZES if cuda else CPU_SIZES)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 2)
    repeats = args.repeats if args.repeats is not None else (10 if cuda else 5)

    compute_only = args.compute_only or world == 1
    # Every rank creates every group in the same order (new_group is collective over the world).
    groups = {} if compute_only else mesh_groups((n0, n1))
    mine: dict[str, tuple[object, int]] = {}
    for axes, members in groups.items():
        for ranks in members:
            g = dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)
            if rank in ranks:
                mine[axes] = (g, len(ranks))

    dtypes = tuple(dict.fromkeys((*MATMUL_DTYPES[dev.type], args.dtype)))
    progress = _Progress(args.progress, total=len(groups) * len(COLLECTIVES) + len(dtypes) + 2 + (not compute_only),
                         enabled=rank == 0)
    medians: list[float] = []  # this rank's median per measured point, in a fixed order

    def inner_for(size: int) -> int:
        # Small messages: batch up to 10 back-to-back calls per timing, so that the skew with which
        # ranks leave the barrier (and scheduler wake-ups) does not dominate a fast call. The same
        # count on every rank, as the calls are collective.
        return min(10, max(1, math.ceil(max(sizes) / 4 / size)))

    def timed(fn, inner: int = 1, repeats: int = repeats) -> float:
        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(repeats):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            times.append((time.perf_counter() - t0) / inner)
        return statistics.median(times)

    def lockstep_seconds(fn) -> float:
        # Seconds per call of fn in lock-step segments of ~SEGMENT_SECONDS between world barriers.
        for _ in range(max(warmup, 1)):
            fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        dist.all_reduce(one, op=dist.ReduceOp.MAX)  # every rank makes the same number of calls
        calls = max(1, round(SEGMENT_SECONDS / float(one.item())))
        times = []
        for _ in range(SEGMENTS):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            dist.barrier()
            times.append((time.perf_counter() - t0) / calls)
        return min(times)

    # --- compute: matmul FLOP/s per dtype and copy bandwidth, on every rank at once
    mm_n = args.matmul_n or (8192 if cuda else 1024)
    mm_dtype = getattr(torch, args.dtype)

    def matmul_size(name: str) -> int:
        # --dtype's figure is the planner's peak: always mm_n. Another dtype may have no fast kernel
        # here (bfloat16 on a CPU without AMX: ~1 GFLOP/s, 2 s a 1024^3 call, 16 s on 4 ranks of 2
        # cores); it is measured at the largest n <= mm_n (halving) whose call a probe at mm_n / 8
        # (times 8^3) puts under SEGMENT_SECONDS, the same n on every rank.
        if name == args.dtype:
            return mm_n
        n = max(1, mm_n // 8)
        a = torch.randn(n, n, device=dev, dtype=getattr(torch, name))
        torch.mm(a, a)
        sync()
        t0 = time.perf_counter()
        torch.mm(a, a)
        sync()
        probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        call, size = float(probe.item()) * (mm_n / n) ** 3, mm_n
        while call > SEGMENT_SECONDS and size > n:
            call, size = call / 8, size // 2
        return size

    mm_sizes = {}
    for name in dtypes:
        mm_sizes[name] = n = matmul_size(name)
        a = torch.randn(n, n, device=dev, dtype=getattr(torch, name))
        b = torch.randn(n, n, device=dev, dtype=getattr(torch, name))
        medians.append(lockstep_seconds(lambda: torch.mm(a, b)))
        del a, b
        progress.step(f"matmul {name}")
    copy_bytes = args.copy_bytes or (2 * GiB if cuda else 64 * MiB)
    src = torch.empty(copy_bytes // 4, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    medians.append(lockstep_seconds(lambda: dst.copy_(src)))
    del src, dst
    progress.step("memory copy")
    # Kernel classes far below the matmul peak (mesh.KERNEL_CLASSES), forward + backward like a
    # training step; their FLOPs count as ops.flops counts them, times (1 + BACKWARD_FLOPS_FACTOR)
    # as strategies.py charges them.
    from alpa_lite.compiler.strategies import BACKWARD_FLOPS_FACTOR

    b_, h_, s_, d_ = (8, 16, 1024, 128) if cuda else (4, 4, 128, 64)
    q, k, v = (torch.randn(b_, h_, s_, d_, device=dev, dtype=mm_dtype, requires_grad=True) for _ in range(3))
    medians.append(lockstep_seconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()))
    x = torch.randn(64 * 2**20 if cuda else 2**20, device=dev, dtype=mm_dtype, requires_grad=True)
    medians.append(lockstep_seconds(lambda: torch.nn.functional.gelu(x, approximate="tanh").sum().backward()))
    kernels = {"attention": (1 + BACKWARD_FLOPS_FACTOR) * 4.0 * b_ * h_ * s_ * s_ * d_,
               "pointwise": (1 + BACKWARD_FLOPS_FACTOR) * float(x.numel())}
    del q, k, v, x
    progress.step("attention, pointwise")

    # --- collectives, then point to point: rank 0 <-> last rank ping-pong, one way = half the round trip
    def collective_curve(axes: str, kind: str, repeats: int) -> list[float]:
        g, n = mine[axes]
        out = []
        for numel in curve_numels[axes]:  # fp32 elements, divisible by the group size
            if kind == "all-reduce":
                x = torch.ones(numel, device=dev)
                fn = lambda x=x: dist.all_reduce(x, group=g)  # noqa: E731
            elif kind == "all-gather":
                outs, inp = [torch.empty(numel // n, device=dev) for _ in range(n)], torch.ones(numel // n, device=dev)
                fn = lambda outs=outs, inp=inp: dist.all_gather(outs, inp, group=g)  # noqa: E731
            elif kind == "reduce-scatter":
                out1, inps = torch.empty(numel // n, device=dev), [torch.ones(numel // n, device=dev) for _ in range(n)]
                fn = lambda out1=out1, inps=inps: dist.reduce_scatter(out1, inps, group=g)  # noqa: E731
            else:
                outs, inps = ([torch.empty(numel // n, device=dev) for _ in range(n)],
                              [torch.ones(numel // n, device=dev) for _ in range(n)])
                fn = lambda outs=outs, inps=inps: dist.all_to_all(outs, inps, group=g)  # noqa: E731
            out.append(timed(fn, inner_for(numel * 4), repeats))
        return out

    last = world - 1

    def p2p_curve(repeats: int) -> list[float]:
        out = []
        for nbytes in p2p_bytes:
            buf = torch.ones(nbytes // 4, device=dev)
            if rank == 0:
                fn = lambda buf=buf: (dist.send(buf, last), dist.recv(buf, last))  # noqa: E731
            elif rank == last:
                fn = lambda buf=buf: (dist.recv(buf, 0), dist.send(buf, 0))  # noqa: E731
            else:
                fn = lambda: None  # noqa: E731
            out.append(timed(fn, inner_for(nbytes), repeats) / 2)
        return out

    # (axes, kind, n, actual bytes) per point; tiny sizes may merge after rounding to the group size
    curve_numels = {axes: sorted({max(n, (size // 4) // n * n) for size in sizes}) for axes, (_, n) in mine.items()}
    points = [(axes, kind, n, numel * 4) for axes, (_, n) in mine.items() for kind in COLLECTIVES
              for numel in curve_numels[axes]]
    p2p_bytes = [] if compute_only else [numel * 4 for numel in sorted({max(1, size // 4) for size in sizes})]
    curves = [((axes, kind, n), lambda r, axes=axes, kind=kind: collective_curve(axes, kind, r))
              for axes, (_, n) in mine.items() for kind in COLLECTIVES]
    if not compute_only:
        curves.append(((None, P2P, 2), p2p_curve))
    for (axes, kind, _), measure in curves:
        medians.extend(measure(repeats))
        progress.step(f"axis {axes} {kind}" if axes else f"send/recv 0<->{last}")

    # --- max over ranks of the medians. A curve whose times do not grow with the size (a busy
    # machine delayed its small messages) is measured again with twice the repeats, at most
    # REMEASURES times; every rank sees the same maxima, so all take the same decisions.
    t = torch.tensor(medians, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    t = t.cpu().tolist()
    start = len(medians) - len(points) - len(p2p_bytes)  # the curves follow the compute figures
    for (axes, kind, n), measure in curves:
        xs = p2p_bytes if axes is None else [numel * 4 for numel in curve_numels[axes]]
        span = slice(start, start + len(xs))
        for attempt in range(1, REMEASURES + 1):
            try:
                fit_alpha_beta(xs, t[span], kind=kind, n=n)
                break
            except ValueError:
                again = torch.tensor(measure(repeats * 2**attempt), dtype=torch.float64, device=dev)
                dist.all_reduce(again, op=dist.ReduceOp.MAX)
                t[span] = again.cpu().tolist()
        start += len(xs)
    if rank == 0:
        spec = _build_cluster(args, t, points, p2p_bytes, groups, (n0, n1), world, mm_sizes, copy_bytes, warmup,
                              repeats, cuda, dev, kernels, compute_only)
        Path(args.out).write_text(spec.to_json())
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _build_cluster(args, t, points, p2p_bytes, groups, shape, world, mm_sizes, copy_bytes, warmup, repeats,
                   cuda, dev, kernels: dict[str, float], compute_only: bool) -> ClusterSpec:
    import torch
    import torch.distributed as dist

    n0, n1 = shape
    key = f"{n0}x{n1}"
    matmul_flops = {name: 2.0 * n**3 / seconds for (name, n), seconds in zip(mm_sizes.items(), t)}
    t = t[len(mm_sizes):]
    mm_n = mm_sizes[args.dtype]
    copy_s = t[0]
    kernel_flops = {kind: flops / seconds for (kind, flops), seconds in zip(kernels.items(), t[1:3])}
    coll_t, p2p_t = t[3:3 + len(points)], t[3 + len(points):]
    peak_flops = matmul_flops[args.dtype]
    mem_bw = 2.0 * copy_bytes / copy_s  # read + write
    if cuda:
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
        device_name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(dev).lower()).strip("-")
    else:
        memory = _memory_bytes_total() / world  # the ranks share this machine's memory
        device_name = "cpu"
    compute = {"matmul_n": mm_n, "matmul_dtype": args.dtype, "matmul_seconds": 2.0 * mm_n**3 / peak_flops,
               "matmul_flops": matmul_flops, "matmul_sizes": mm_sizes, "peak_flops": peak_flops, "copy_bytes": copy_bytes,
               "copy_seconds": copy_s, "mem_bandwidth": mem_bw, "memory_bytes": memory,
               "kernel_flops": kernel_flops, "kernel_flops_per_call": kernels}
    about = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "torch": torch.__version__, "backend": dist.get_backend(), "device": device_name, "world_size": world,
             "warmup": warmup, "repeats": repeats, "compute": compute}
    if compute_only:
        base = get_cluster(args.base or ("a100" if cuda else "cpu-gloo"))
        return replace(base, name=f"profiled-{device_name}-compute+{base.name}", peak_flops=peak_flops,
                       mem_bandwidth=mem_bw, memory_bytes=memory, kernel_flops=kernel_flops,
                       measurements={**base.measurements, **about, "network_from": base.name})

    curves: dict[str, dict[str, dict]] = {}
    for axes in groups:
        for kind in COLLECTIVES:
            idx = [i for i, p in enumerate(points) if p[0] == axes and p[1] == kind]
            n = points[idx[0]][2]
            xs, ts = [points[i][3] for i in idx], [coll_t[i] for i in idx]
            entry: dict = {"n": n}
            try:
                f = fit_alpha_beta(xs, ts, kind=kind, n=n)
                entry.update(alpha=f.alpha, beta=f.beta, residual=f.residual)
            except ValueError as e:
                entry["error"] = str(e)
            entry.update(bytes=xs, seconds=ts)
            curves.setdefault(kind, {})[axes] = entry
    p2p: dict = {"src": 0, "dst": world - 1}
    try:
        f = fit_alpha_beta(p2p_bytes, p2p_t, kind=P2P, n=2)
        p2p.update(alpha=f.alpha, beta=f.beta, residual=f.residual)
    except ValueError as e:
        p2p["error"] = str(e)
    p2p.update(bytes=p2p_bytes, seconds=p2p_t)

    def ar_link(axes: str) -> Link:
        e = curves["all-reduce"][axes]
        if "error" in e:
            raise ValueError(f"all-reduce on mesh axis {axes}: {e['error']}")
        return Link(e["alpha"], e["beta"])

    whole = "01" if "01" in groups else ("1" if n1 > 1 else "0")  # the group spanning every rank
    world_link = ar_link(whole)
    links = (ar_link("0") if n0 > 1 else world_link, ar_link("1") if n1 > 1 else world_link)
    measurements = {
        "units": {"alpha": "s", "beta": "s per effective byte (all-reduce 2(n-1)/n*B, others (n-1)/n*B, "
                  "send-recv B)", "bytes": "B as in LogicalMesh.collective_cost", "seconds": "s, max over ranks "
                  "of each rank's median", "residual": "relative RMS error of the fit"},
        **about,
        "meshes": {key: {"groups": groups, "collectives": curves, "p2p": p2p}},
    }
    return ClusterSpec(name=f"profiled-{device_name}-{key}", num_nodes=1, devices_per_node=world,
                       peak_flops=peak_flops, mem_bandwidth=mem_bw, memory_bytes=memory,
                       intra_node=world_link, inter_node=world_link, mesh_links={key: links},
                       use_curves=bool(args.use_curves), measurements=measurements, kernel_flops=kernel_flops)


# ----------------------------------------------------------------------------------- parent


def _sizes_arg(values: list[str] | None) -> list[int] | None:
    if not values:
        return None
    return sorted({parse_size(v) for item in values for v in item.split(",") if v.strip()})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``alpa-lite profile``."""
    parser.add_argument("--nproc", type=int, required=True,
                        help="ranks (devices) to profile; 1 measures the compute figures only")
    parser.add_argument("--mesh", default=None, help="logical mesh shape n0xn1 over the ranks (default 1xNPROC)")
    parser.add_argument("--out", default="cluster.json", help="cluster JSON to write (default cluster.json)")
    parser.add_argument("--sizes", nargs="+", default=None, metavar="SIZE",
                        help="message sizes B, e.g. 4K 64K 1M (binary prefixes; default 4K..4M on CPU, "
                             "256K..1G on CUDA, x4 steps)")
    parser.add_argument("--use-curves", action="store_true",
                        help="plan with the measured curves (interpolated) instead of the alpha-beta fits")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls per point (default 2 CPU, 3 CUDA)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 5 CPU, 10 CUDA)")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit for the whole run, s (default 600)")
    parser.add_argument("--compute-only", action="store_true",
                        help="measure only the compute figures (matmul FLOP/s per dtype, memory bandwidth, kernel "
                             "classes); the network comes from --base (always so with --nproc 1)")
    parser.add_argument("--base", default=None, metavar="CLUSTER",
                        help="preset or cluster JSON whose nodes and links a compute-only profile keeps "
                             "(default cpu-gloo on CPU, a100 on CUDA)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the dtype the model trains in: peak_flops and the kernel classes are measured in it "
                             "(default float32)")


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m alpa_lite.tools.profile --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mesh", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", type=int, nargs="*", default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--progress", default=None)
    p.add_argument("--use-curves", action="store_true")
    p.add_argument("--coll-timeout", type=float, default=60.0)
    p.add_argument("--matmul-n", type=int, default=None)
    p.add_argument("--copy-bytes", type=int, default=None)
    p.add_argument("--compute-only", action="store_true")
    p.add_argument("--base", default=None)
    p.add_argument("--dtype", default="float32")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``alpa-lite profile`` with parsed ``args`` (see :func:`add_arguments`).

    Returns:
        0 on success (the cluster file is written and loads back), else non-zero after
        printing why (with the tail of the ranks' log).
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from alpa_lite.runtime.launch import torchrun

    console = Console()
    try:
        nproc = int(args.nproc)
        shape = parse_mesh_shape(args.mesh) if args.mesh else (1, nproc)
        sizes = _sizes_arg(args.sizes)
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        if args.base is not None:
            get_cluster(args.base)  # an unknown preset or unreadable file fails before the ranks start
        if shape[0] * shape[1] != nproc:
            raise ValueError(f"--mesh {shape[0]}x{shape[1]} has {shape[0] * shape[1]} devices, --nproc is {nproc}")
        for opt in ("warmup", "repeats"):
            v = getattr(args, opt, None)
            if v is not None and v < (0 if opt == "warmup" else 1):
                raise ValueError(f"--{opt} must be {'>= 0' if opt == 'warmup' else '>= 1'}, got {v}")
        if sizes is not None and len(sizes) < 2:
            raise ValueError("--sizes needs at least 2 distinct sizes to fit a line")
    except ValueError as e:
        console.print(f"[red]alpa-lite profile: {e}[/red]")
        return 2
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    timeout = float(getattr(args, "timeout", 600.0) or 600.0)

    with tempfile.TemporaryDirectory(prefix="alpa-lite-profile-") as tmp:
        progress_file, log_file = Path(tmp, "progress.json"), Path(tmp, "ranks.log")
        target = ["-m", "alpa_lite.tools.profile", "--worker", "--mesh", f"{shape[0]}x{shape[1]}", "--out", str(out),
                  "--progress", str(progress_file), "--coll-timeout", str(max(30.0, min(timeout, 300.0)))]
        if sizes:
            target += ["--sizes", *map(str, sizes)]
        for opt in ("warmup", "repeats"):
            if getattr(args, opt, None) is not None:
                target += [f"--{opt}", str(getattr(args, opt))]
        if getattr(args, "use_curves", False):
            target.append("--use-curves")
        if args.compute_only:
            target.append("--compute-only")
        if args.base is not None:
            target += ["--base", str(Path(args.base).resolve()) if Path(args.base).is_file() else args.base]
        target += ["--dtype", args.dtype]
        if out.exists():
            out.unlink()
        result: dict = {}

        def launch():
            with open(log_file, "w") as log:
                try:
                    result["rc"] = torchrun(target, nproc, timeout_s=timeout, stdout=log, stderr=log)
                except BaseException as e:  # TimeoutError, or anything else: report it in the main thread
                    result["error"] = e

        t0 = time.monotonic()
        thread = threading.Thread(target=launch, daemon=True)
        with Progress(TextColumn("[bold]profile[/bold] {task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console,
                      transient=False) as bar:
            task = bar.add_task(f"{nproc} ranks, mesh {shape[0]}x{shape[1]}: starting", total=None)
            thread.start()
            while thread.is_alive():
                thread.join(0.2)
                try:
                    p = json.loads(progress_file.read_text())
                    bar.update(task, completed=p["done"], total=p["total"], description=p["step"])
                except (OSError, ValueError, KeyError):
                    pass
            if result.get("rc") == 0:
                bar.update(task, description="done", completed=bar.tasks[0].total or 1)
        elapsed = time.monotonic() - t0
        if "error" in result or result.get("rc") != 0 or not out.is_file():
            why = result.get("error") or f"ranks exited with code {result.get('rc')}"
            log_tail = _rank_error(log_file.read_text(errors="replace")) if log_file.exists() else ""
            console.print(f"[red]alpa-lite profile failed: {why}[/red]")
            if log_tail:
                console.print(log_tail, markup=False, highlight=False)
            return result.get("rc") or 1
    try:
        spec = ClusterSpec.load(out)
    except ValueError as e:
        console.print(f"[red]alpa-lite profile wrote an unreadable cluster file: {e}[/red]")
        return 1
    print_report(spec, console)
    console.print(f"wrote {out} in {elapsed:.1f} s" + (" (planning with the measured curves)" if spec.use_curves else ""))
    return 0


def _rank_error(log: str, lines: int = 30) -> str:
    """What to show of the ranks' log when they failed: the first rank's traceback (torchrun's
    summary only says which rank exited), else the last ``lines`` lines."""
    text = log.splitlines()
    first = next((i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last)")), None)
    if first is None:
        return "\n".join(text[-lines:])
    end = next((i + 1 for i in range(first + 1, len(text)) if text[i] and not text[i][0].isspace()), len(text))
    return "\n".join(text[first:end])


def print_report(spec: ClusterSpec, console=None) -> None:
    """A rich table of the fits of a profiled cluster: axis, kind, alpha (us), 1/beta (GB/s), residual."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m = spec.measurements
    for key, mesh in m.get("meshes", {}).items():
        table = Table(title=f"{spec.name}: alpha-beta fits, mesh {key} "
                            f"({m.get('backend', '?')}, {m.get('world_size', '?')} ranks)")
        for col, just in (("axis", "left"), ("kind", "left"), ("n", "right"), ("alpha (us)", "right"),
                          ("1/beta (GB/s)", "right"), ("residual", "right")):
            table.add_column(col, justify=just)
        rows = [(axes, kind, e) for kind, per in mesh.get("collectives", {}).items() for axes, e in per.items()]
        rows.sort(key=lambda r: (len(r[0]), r[0], COLLECTIVES.index(r[1]) if r[1] in COLLECTIVES else 9))
        if "p2p" in mesh:
            p = mesh["p2p"]
            rows.append((f"{p.get('src')}<->{p.get('dst')}", P2P, {**p, "n": 2}))
        for axes, kind, e in rows:
            if "error" in e:
                table.add_row(axes, kind, str(e.get("n", "")), "-", "-", f"[red]{e['error'][:60]}[/red]")
            else:
                table.add_row(axes, kind, str(e.get("n", "")), f"{e['alpha'] * 1e6:.1f}",
                              f"{1 / e['beta'] / 1e9:.3f}", f"{e['residual']:.1%}")
        console.print(table)
    c = m.get("compute", {})
    sizes = c.get("matmul_sizes", {})
    others = "".join(f"; {k} {v / 1e9:.1f} at {sizes.get(k, '?')}^3" for k, v in c.get("matmul_flops", {}).items()
                     if k != c.get("matmul_dtype"))
    console.print(f"device: {spec.peak_flops / 1e9:.1f} GFLOP/s ({c.get('matmul_n', '?')}^3 {c.get('matmul_dtype', '')} "
                  f"matmul{others}), "
                  f"{spec.mem_bandwidth / 1e9:.2f} GB/s copy, {spec.memory_bytes / GiB:.2f} GiB memory"
                  + "".join(f", {kind} {rate / 1e9:.1f} GFLOP/s" for kind, rate in spec.kernel_flops.items()))
    if "network_from" in m:
        console.print(f"compute measured on {m.get('world_size', '?')} rank(s); nodes and links from "
                      f"cluster {m['network_from']!r} ({spec.num_nodes} x {spec.devices_per_node} devices)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m alpa_lite.tools.profile [options]``: the profile command; ``--worker``: one rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        return _worker(_worker_parser().parse_args(argv))
    parser = argparse.ArgumentParser(prog="alpa-lite profile", description="Measure the collectives, compute and "
                                     "memory of this machine's devices; write a cluster JSON.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
