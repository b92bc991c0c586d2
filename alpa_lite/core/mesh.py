"""Cluster descriptions, logical device meshes and the alpha-beta collective cost model.

Every collective's cost formula lives here (docs/planner.md, "Costs per strategy"). For a collective along
mesh axis ``k`` with ``n`` devices, latency ``alpha_k`` (seconds) and inverse bandwidth
``beta_k`` (seconds/byte), moving ``B`` bytes:

- all-reduce of a B-byte tensor:                  ``alpha_k + 2 (n-1)/n * B * beta_k``
- all-gather to a B-byte result:                  ``alpha_k +   (n-1)/n * B * beta_k``
- reduce-scatter of a B-byte input:               ``alpha_k +   (n-1)/n * B * beta_k``
- all-to-all of B bytes held per device:          ``alpha_k +   (n-1)/n * B * beta_k``

(ring algorithms; Thakur et al., IJHPCA 2005; the same model as Alpa, OSDI'22, section 4.2).
A collective over both axes (``S01``) runs on the flattened group: ``n = n0 * n1`` with the
larger alpha and beta of the two axes.

Measured collective curves (opt-in). ``alpa-lite profile`` records, per collective kind and mesh
axis, the measured seconds at each swept size. With ``LogicalMesh(..., collective_curves=...)``,
or a cluster JSON with ``"use_curves": true``, :meth:`LogicalMesh.collective_cost` (through which
``all_reduce_cost`` and friends route) interpolates that curve piecewise-linearly
(``numpy.interp``) instead of using the formula above, as Alpa's profiling database does
(``alpa/mesh_profiling.py``). Below the first point the first time is used; beyond the last point
the line through the last two points is extended (slope floored at 0). A kind or axis group
without a curve keeps the formula. Without curves every cost is exactly the formula.

Compute is a roofline, ``max(flops / rate, bytes / mem_bandwidth)``, with ``rate`` the matmul
``peak_flops`` unless the kernel belongs to a class in ``kernel_flops`` (measured by ``alpa-lite
profile``): ``"attention"`` (``scaled_dot_product_attention``) and ``"pointwise"`` (elementwise ops
that compute more than they move, such as GELU or layer norm, one FLOP per element) run far
below the matmul peak on CPUs (``strategies.kernel_class`` assigns the classes).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

GB = 1e9
GiB = 2**30

KERNEL_CLASSES = ("attention", "pointwise")


def _check_kernel_flops(kernel_flops, where: str) -> None:
    """Raise ValueError unless ``kernel_flops`` maps known kernel classes to positive FLOP/s."""
    if not isinstance(kernel_flops, (dict, tuple)):
        raise ValueError(f"{where} must map kernel classes to FLOP/s, got {kernel_flops!r}")
    for kind, rate in dict(kernel_flops).items():
        if kind not in KERNEL_CLASSES:
            raise ValueError(f"{where}: unknown kernel class {kind!r}; known: {', '.join(KERNEL_CLASSES)}")
        if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
            raise ValueError(f"{where}[{kind!r}] must be a positive number of FLOP/s, got {rate!r}")


@dataclass(frozen=True)
class Link:
    """A network level: latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte)."""

    alpha: float
    beta: float

    def __post_init__(self):
        if not (self.alpha >= 0 and self.beta > 0 and math.isfinite(self.alpha) and math.isfinite(self.beta)):
            raise ValueError(f"a link needs alpha >= 0 s and beta > 0 s/byte, got alpha={self.alpha}, beta={self.beta}")


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster of ``num_nodes`` x ``devices_per_node`` identical devices.

    Attributes:
        peak_flops: achievable matmul FLOP/s of one device.
        mem_bandwidth: device memory bandwidth, bytes/s.
        memory_bytes: device memory capacity, bytes.
        intra_node / inter_node: links inside a node and between nodes.
        mesh_links: measured per-axis links for given logical mesh shapes (``"2x2"`` ->
            [axis-0 link, axis-1 link]), written by ``alpa-lite profile``; they win over the
            intra/inter figures for that shape.
        use_curves: cost collectives by the measured curves in ``measurements`` (see the
            module docstring) for the mesh shapes that have them; JSON key ``"use_curves"``.
        kernel_flops: achieved FLOP/s of kernel classes slower than matmul (``"attention"``,
            ``"pointwise"``; module docstring), written by ``alpa-lite profile``; JSON key
            ``"kernel_flops"``, left out when empty (every kernel at ``peak_flops``).
        measurements: what ``alpa-lite profile`` measured (fits and raw curves), kept as read.
            Curves live at ``measurements["meshes"]["2x2"]["collectives"][kind][axes]`` with
            ``axes`` one of ``"0"``, ``"1"``, ``"01"`` and value ``{"bytes": [...], "seconds": [...]}``.
    """

    name: str
    num_nodes: int
    devices_per_node: int
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float
    intra_node: Link
    inter_node: Link
    mesh_links: dict[str, tuple[Link, Link]] = field(default_factory=dict)
    use_curves: bool = False
    measurements: dict = field(default_factory=dict)
    kernel_flops: dict = field(default_factory=dict)

    def __post_init__(self):
        _check_kernel_flops(self.kernel_flops, f"cluster {self.name!r}: kernel_flops")
        for key in ("num_nodes", "devices_per_node"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"cluster {self.name!r}: {key} must be >= 1")
        for key in ("peak_flops", "mem_bandwidth", "memory_bytes"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"cluster {self.name!r}: {key} must be a positive number, got {v!r}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def logical_mesh(self, shape: tuple[int, int]) -> "LogicalMesh":
        """The logical mesh of ``shape`` laid on this cluster.

        Axis 1 is the minor (fastest) axis. An axis whose devices all sit in one node uses the
        intra-node link, else the inter-node one.

        Raises:
            ValueError: when the mesh needs more devices than the cluster has.
        """
        n0, n1 = _check_shape(shape)
        if n0 * n1 > self.num_devices:
            raise ValueError(f"mesh {n0}x{n1} needs {n0 * n1} devices; cluster {self.name!r} has {self.num_devices}")
        key = f"{n0}x{n1}"
        if key in self.mesh_links:
            a0, a1 = self.mesh_links[key]
        else:
            a1 = self.intra_node if n1 <= self.devices_per_node else self.inter_node
            a0 = self.intra_node if n0 * n1 <= self.devices_per_node else self.inter_node
        return LogicalMesh((n0, n1), mesh_alpha=(a0.alpha, a1.alpha), mesh_beta=(a0.beta, a1.beta),
                           peak_flops=self.peak_flops, mem_bandwidth=self.mem_bandwidth,
                           memory_bytes=self.memory_bytes, cluster=self.name,
                           collective_curves=self.collective_curves((n0, n1)) if self.use_curves else None,
                           kernel_flops=self.kernel_flops, spec=self)

    def collective_curves(self, shape: tuple[int, int]) -> dict | None:
        """The measured curves for mesh ``shape`` (``{kind: {axes: {"bytes", "seconds"}}}``), or None."""
        n0, n1 = _check_shape(shape)
        curves = self.measurements.get("meshes", {}).get(f"{n0}x{n1}", {}).get("collectives")
        return curves or None

    def to_json(self) -> str:
        d = asdict(self)
        d["mesh_links"] = {k: [asdict(a), asdict(b)] for k, (a, b) in self.mesh_links.items()}
        if not self.use_curves:  # keep the files of unprofiled clusters as they were
            del d["use_curves"]
        if not self.measurements:
            del d["measurements"]
        if not self.kernel_flops:
            del d["kernel_flops"]
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, source: str = "cluster description") -> "ClusterSpec":
        """Build and validate a cluster from its JSON dict.

        Raises:
            ValueError: naming the missing or invalid field.
        """
        required = ["name", "num_nodes", "devices_per_node", "peak_flops", "mem_bandwidth",
                    "memory_bytes", "intra_node", "inter_node"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        try:
            links = {}
            for key, pair in d.get("mesh_links", {}).items():
                _check_shape(tuple(int(x) for x in key.split("x")))
                if len(pair) != 2:
                    raise ValueError(f"mesh_links[{key!r}] needs one link per mesh axis (2), got {len(pair)}")
                links[key] = (_link(pair[0], f"mesh_links[{key!r}][0]"), _link(pair[1], f"mesh_links[{key!r}][1]"))
            use_curves, measurements = d.get("use_curves", False), d.get("measurements", {})
            if not isinstance(use_curves, bool):
                raise ValueError(f"use_curves must be true or false, got {use_curves!r}")
            if not isinstance(measurements, dict):
                raise ValueError(f"measurements must be a JSON object, got {type(measurements).__name__}")
            if use_curves:  # validate every curve now, not at the first cost query
                for key, m in measurements.get("meshes", {}).items():
                    _normalize_curves(m.get("collectives") or {}, where=f"measurements.meshes[{key!r}].collectives")
            return cls(name=str(d["name"]), num_nodes=int(d["num_nodes"]),
                       devices_per_node=int(d["devices_per_node"]), peak_flops=float(d["peak_flops"]),
                       mem_bandwidth=float(d["mem_bandwidth"]), memory_bytes=float(d["memory_bytes"]),
                       intra_node=_link(d["intra_node"], "intra_node"),
                       inter_node=_link(d["inter_node"], "inter_node"),
                       mesh_links=links, use_curves=use_curves, measurements=measurements,
                       kernel_flops=dict(d.get("kernel_flops", {})))
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ClusterSpec":
        """Read a cluster JSON file (as written by ``to_json`` or ``alpa-lite profile``).

        Raises:
            ValueError: on unreadable JSON or an invalid field.
        """
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read cluster file {path}: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"cluster file {path}: expected a JSON object")
        return cls.from_dict(d, source=f"cluster file {path}")


# Figures: A100-80GB bf16 dense peak 312 TFLOP/s (we plan with fp32 training in mind but use the
# tensor-core figure, as Alpa's cost model does), HBM2e 2.0 TB/s, NVLink3 300 GB/s per direction,
# 4x200 Gb/s InfiniBand per node = 100 GB/s. V100-16GB (Alpa's testbed, p3.16xlarge): 125 TFLOP/s,
# 900 GB/s HBM2, NVLink ~130 GB/s effective, 25 Gb/s Ethernet between nodes = 3.125 GB/s.
# unit: alpha 1 s and beta 1 s/byte on every axis, compute a mere tie-breaker (1 TFLOP/s, 1 TB/s), as in
# Alpa's solver tests, which price communication only.
# cpu-gloo: this project's test machine, figures measured with `alpa-lite profile --nproc 4`.
PRESETS: dict[str, ClusterSpec] = {
    "a100": ClusterSpec("a100", num_nodes=8, devices_per_node=8, peak_flops=312e12, mem_bandwidth=2.0e12,
                        memory_bytes=80 * GiB, intra_node=Link(5e-6, 1 / 300e9),
                        inter_node=Link(1e-5, 1 / 100e9)),
    "v100": ClusterSpec("v100", num_nodes=8, devices_per_node=8, peak_flops=125e12, mem_bandwidth=0.9e12,
                        memory_bytes=16 * GiB, intra_node=Link(5e-6, 1 / 130e9),
                        inter_node=Link(2e-5, 1 / 3.125e9)),
    "cpu-gloo": ClusterSpec("cpu-gloo", num_nodes=1, devices_per_node=8, peak_flops=2e10, mem_bandwidth=5e9,
                            memory_bytes=4 * GiB, intra_node=Link(1e-4, 1 / 1.0e9),
                            inter_node=Link(1e-4, 1 / 1.0e9)),
    "unit": ClusterSpec("unit", num_nodes=64, devices_per_node=1, peak_flops=1e12, mem_bandwidth=1e12,
                        memory_bytes=1e30, intra_node=Link(1.0, 1.0), inter_node=Link(1.0, 1.0)),
}


def get_cluster(name_or_path: str | Path | ClusterSpec) -> ClusterSpec:
    """A preset by name (``a100``, ``v100``, ``cpu-gloo``, ``unit``) or a cluster JSON file.

    Raises:
        ValueError: for an unknown name that is not a readable file.
    """
    if isinstance(name_or_path, ClusterSpec):
        return name_or_path
    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]
    if Path(name_or_path).is_file():
        return ClusterSpec.load(name_or_path)
    if str(name_or_path).endswith(".json"):
        raise ValueError(f"cluster file {name_or_path} does not exist")
    raise ValueError(f"unknown cluster {name_or_path!r}: use a preset ({', '.join(PRESETS)}) or a JSON file")


def _link(d, where: str) -> Link:
    """A ``Link`` from its JSON dict; errors name the field ``where``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a link is an object {{\"alpha\": s, \"beta\": s/byte}}, got {d!r}")
    missing = [k for k in ("alpha", "beta") if k not in d]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    try:
        return Link(float(d["alpha"]), float(d["beta"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def bytes_factor(kind: str, n: int) -> float:
    """The multiplier of ``B * beta`` in the alpha-beta cost of collective ``kind`` on ``n`` devices.

    ``2 (n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all
    (module docstring). ``factor * B`` is the collective's "effective bytes".

    Raises:
        ValueError: on an unknown kind.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n


def _axes_key(axes) -> tuple[int, ...]:
    if isinstance(axes, str):  # "0", "1", "01"
        axes = [int(c) for c in axes]
    key = tuple(sorted({int(a) for a in axes}))
    if not key or not set(key) <= {0, 1}:
        raise ValueError(f"mesh axes must be a non-empty subset of (0, 1), got {axes!r}")
    return key


def _normalize_curves(curves, where: str = "collective_curves") -> tuple:
    """Measured curves -> a hashable, validated tuple of ``(kind, axes, bytes, seconds)``.

    Accepts ``{kind: {axes: {"bytes": [...], "seconds": [...]} | (bytes, seconds)}}`` (``axes``
    a tuple of mesh axes or a string like ``"01"``) or the tuple form this returns.
    """
    if isinstance(curves, tuple):
        return curves
    out = []
    for kind, per_axes in curves.items():
        if kind not in COLLECTIVES:
            raise ValueError(f"{where}: unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
        for axes, curve in per_axes.items():
            at = f"{where}[{kind!r}][{axes!r}]"
            xs, ts = (curve["bytes"], curve["seconds"]) if isinstance(curve, dict) else curve
            xs, ts = tuple(float(x) for x in xs), tuple(float(t) for t in ts)
            if len(xs) != len(ts) or len(xs) < 2:
                raise ValueError(f"{at}: needs >= 2 (bytes, seconds) points of equal count, got {len(xs)} and {len(ts)}")
            if not all(b > a for a, b in zip(xs, xs[1:])) or xs[0] < 0:
                raise ValueError(f"{at}: bytes must be non-negative and strictly increasing, got {xs}")
            if not all(t >= 0 and math.isfinite(t) for t in ts):
                raise ValueError(f"{at}: seconds must be finite and >= 0, got {ts}")
            out.append((kind, _axes_key(axes), xs, ts))
    return tuple(sorted(out))


def interpolate_curve(xs, ts, nbytes: float) -> float:
    """Piecewise-linear time (s) at ``nbytes`` on a measured curve (bytes ``xs`` -> seconds ``ts``).

    ``numpy.interp`` inside the measured range, the first time below it, and beyond the last
    point the line through the last two points (slope floored at 0, so more bytes never cost less).
    """
    if nbytes <= xs[-1]:
        return float(np.interp(nbytes, xs, ts))
    slope = max((ts[-1] - ts[-2]) / (xs[-1] - xs[-2]), 0.0)
    return float(ts[-1] + (nbytes - xs[-1]) * slope)


def _check_shape(shape) -> tuple[int, int]:
    shape = tuple(int(x) for x in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"a logical mesh is 2D with positive sizes, got {shape}")
    return shape


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``.

    Raises:
        ValueError: on anything else.
    """
    try:
        return _check_shape(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"mesh shape must look like '2x4' (two sizes >= 1), got {text!r}") from None


@dataclass(frozen=True)
class LogicalMesh:
    """A 2D logical device mesh and the figures the cost model needs.

    Args:
        shape: ``(n0, n1)`` devices along mesh axes 0 and 1.
        mesh_alpha: per-axis collective latency, seconds.
        mesh_beta: per-axis inverse bandwidth, seconds/byte.
        peak_flops: FLOP/s of one device; mem_bandwidth: bytes/s; memory_bytes: capacity, bytes.
        cluster: preset (or ``ClusterSpec``) that supplies every figure not given.
        collective_curves: measured curves to cost collectives by instead of the alpha-beta
            formula, ``{kind: {axes: {"bytes": [...], "seconds": [...]}}}`` with ``axes`` like
            ``(0,)``, ``(1,)``, ``(0, 1)`` or ``"0"``, ``"1"``, ``"01"`` and ``bytes`` the same B
            as the cost methods' ``nbytes``; stored as a hashable tuple. None (default): formula
            only, unless the ``cluster`` consulted for missing figures has ``use_curves``.
        kernel_flops: FLOP/s of the kernel classes of ``KERNEL_CLASSES`` that run below
            ``peak_flops`` (module docstring); None: the ``cluster``'s (none for the presets).

    Raises:
        ValueError: on a shape that is not 2D positive, or non-positive figures, or invalid curves.
    """

    shape: tuple[int, int]
    mesh_alpha: tuple[float, float] | None = None
    mesh_beta: tuple[float, float] | None = None
    peak_flops: float | None = None
    mem_bandwidth: float | None = None
    memory_bytes: float | None = None
    cluster: str = "a100"
    collective_curves: dict | tuple | None = None
    kernel_flops: dict | tuple | None = None
    spec: ClusterSpec | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        shape = _check_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        if any(getattr(self, k) is None for k in ("mesh_alpha", "mesh_beta", "peak_flops", "mem_bandwidth", "memory_bytes")):
            base = get_cluster(self.cluster)
            n = shape[0] * shape[1]
            if n > base.num_devices:  # a described mesh larger than the preset: scale the node count
                base = replace(base, num_nodes=math.ceil(n / base.devices_per_node))
            ref = base.logical_mesh(shape)
            for k in ("mesh_alpha", "mesh_beta", "peak_flops", "mem_bandwidth", "memory_bytes"):
                if getattr(self, k) is None:
                    object.__setattr__(self, k, getattr(ref, k))
            if self.collective_curves is None:
                object.__setattr__(self, "collective_curves", ref.collective_curves)
            if self.kernel_flops is None:
                object.__setattr__(self, "kernel_flops", ref.kernel_flops)
            object.__setattr__(self, "cluster", base.name)
            if self.spec is None:
                object.__setattr__(self, "spec", base)
        if self.collective_curves is not None:
            object.__setattr__(self, "collective_curves", _normalize_curves(self.collective_curves))
        _check_kernel_flops(self.kernel_flops or {}, "kernel_flops")
        object.__setattr__(self, "kernel_flops", tuple(sorted(dict(self.kernel_flops or {}).items())))
        for k in ("mesh_alpha", "mesh_beta"):
            v = tuple(float(x) for x in getattr(self, k))
            if len(v) != 2 or min(v) < 0:
                raise ValueError(f"{k} needs two non-negative figures (one per mesh axis), got {v}")
            object.__setattr__(self, k, v)
        for k in ("peak_flops", "mem_bandwidth", "memory_bytes"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be positive, got {getattr(self, k)}")

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def as_cluster(self) -> ClusterSpec:
        """This mesh as a cluster of ``shape[0]`` nodes of ``shape[1]`` devices, on which the
        inter-op pass lays stage submeshes: axis 0's link between nodes, axis 1's inside one,
        and every calibrated figure of the cluster the mesh was made from (``kernel_flops``,
        measured ``mesh_links`` and collective curves), so each stage's logical mesh keeps them.
        """
        cluster = ClusterSpec(self.cluster, self.shape[0], self.shape[1], self.peak_flops, self.mem_bandwidth,
                              self.memory_bytes, intra_node=Link(self.mesh_alpha[1], max(self.mesh_beta[1], 1e-30)),
                              inter_node=Link(self.mesh_alpha[0], max(self.mesh_beta[0], 1e-30)),
                              kernel_flops=dict(self.kernel_flops))
        if self.spec is not None:
            cluster = replace(cluster, mesh_links=self.spec.mesh_links, use_curves=self.spec.use_curves,
                              measurements=self.spec.measurements)
        return cluster

    def _group(self, axes: tuple[int, ...]) -> tuple[int, float, float]:
        n = math.prod(self.shape[a] for a in axes)
        return n, max(self.mesh_alpha[a] for a in axes), max(self.mesh_beta[a] for a in axes)

    def all_reduce_cost(self, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds to all-reduce an ``nbytes`` tensor over the devices of ``axes``."""
        return self.collective_cost("all-reduce", nbytes, axes)

    def all_gather_cost(self, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds to all-gather into an ``nbytes`` result over the devices of ``axes``."""
        return self.collective_cost("all-gather", nbytes, axes)

    def reduce_scatter_cost(self, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds to reduce-scatter an ``nbytes`` input over the devices of ``axes``."""
        return self.collective_cost("reduce-scatter", nbytes, axes)

    def all_to_all_cost(self, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds for an all-to-all of ``nbytes`` held per device over ``axes``."""
        return self.collective_cost("all-to-all", nbytes, axes)

    def collective_cost(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float:
        """Cost of a collective by its name (``"all-reduce"``, ``"all-gather"``, ...), seconds.

        The one place every collective is costed: the measured curve for ``kind`` on the group of
        ``axes`` (ignoring size-1 axes) when this mesh has one, else the alpha-beta formula
        ``alpha + bytes_factor(kind, n) * nbytes * beta`` (module docstring). 0 on one device.

        Raises:
            ValueError: on an unknown kind.
        """
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
        n, alpha, beta = self._group(axes)
        if n == 1:
            return 0.0
        curve = self._curve(kind, axes)
        if curve is not None:
            return interpolate_curve(*curve, nbytes)
        return alpha + bytes_factor(kind, n) * nbytes * beta

    def marginal_cost(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float:
        """Seconds ``nbytes`` more add to a bucketed collective of ``kind`` over ``axes`` (one
        whose latency is paid once per bucket: gradient buckets, ZeRO-1/2's update all-gathers).

        Without a measured curve: the formula's bandwidth term, ``collective_cost(kind, nbytes)
        - collective_cost(kind, 0)`` (module docstring). With one: ``nbytes`` times the curve's
        mean slope over its measured sizes, ``(t_last - t_first) / (B_last - B_first)``, floored
        at 0. The difference ``cost(nbytes) - cost(0)`` on the curve itself is no marginal cost:
        a curve measured on a busy machine need not grow between nearby sizes (the 1x4
        reduce-scatter curve of docs/cost_fidelity_cluster.json takes 13.9 ms at 4 KiB and
        8.7 ms at 16 KiB), and the ILP then paid a bucket member less than nothing.

        Raises:
            ValueError: on an unknown kind.
        """
        curve = self._curve(kind, axes)
        if curve is None:
            return self.collective_cost(kind, nbytes, axes) - self.collective_cost(kind, 0, axes)
        xs, ts = curve
        return nbytes * max((ts[-1] - ts[0]) / (xs[-1] - xs[0]), 0.0)

    def bucketed_cost(self, kind: str, nbytes: float, axes: tuple[int, ...], bucket_bytes: float) -> float:
        """Seconds a tensor of ``nbytes`` adds to the collectives of ``kind`` over ``axes`` that
        run in buckets of at most ``bucket_bytes``, one latency each (gradient buckets, ZeRO-1/2's
        update all-gathers): its ``marginal_cost`` and its share ``min(1, nbytes /
        bucket_bytes)`` of a latency (a larger tensor is its own bucket). Over ``B`` bytes in
        ``n`` buckets the shares add up to at most ``n``.

        Raises:
            ValueError: on an unknown kind.
        """
        return self.marginal_cost(kind, nbytes, axes) + self.collective_cost(kind, 0, axes) * min(
            1.0, nbytes / bucket_bytes)

    def _curve(self, kind: str, axes: tuple[int, ...]):
        """The measured ``(bytes, seconds)`` curve of ``kind`` on the group of ``axes`` (size-1
        axes ignored), or None."""
        key = tuple(sorted({a for a in axes if self.shape[a] > 1}))
        for k, ax, xs, ts in self.collective_curves or ():
            if k == kind and ax == key:
                return xs, ts
        return None

    def compute_cost(self, flops: float, nbytes: float, kernel: str | None = None) -> float:
        """Roofline time of a kernel, seconds: ``max(flops / rate, nbytes / mem_bandwidth)`` with
        ``rate`` the ``kernel_flops`` of class ``kernel`` when measured, else ``peak_flops``."""
        rate = dict(self.kernel_flops).get(kernel, self.peak_flops) if kernel else self.peak_flops
        return max(flops / rate, nbytes / self.mem_bandwidth)

    def to_dict(self) -> dict:
        d = {"shape": list(self.shape), "mesh_alpha": list(self.mesh_alpha), "mesh_beta": list(self.mesh_beta),
             "peak_flops": self.peak_flops, "mem_bandwidth": self.mem_bandwidth,
             "memory_bytes": self.memory_bytes, "cluster": self.cluster}
        if self.kernel_flops:
            d["kernel_flops"] = dict(self.kernel_flops)
        if self.collective_curves:
            curves: dict = {}
            for kind, axes, xs, ts in self.collective_curves:
                curves.setdefault(kind, {})["".join(map(str, axes))] = {"bytes": list(xs), "seconds": list(ts)}
            d["collective_curves"] = curves
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LogicalMesh":
        return cls(tuple(d["shape"]), tuple(d["mesh_alpha"]), tuple(d["mesh_beta"]), d["peak_flops"],
                   d["mem_bandwidth"], d["memory_bytes"], d.get("cluster", "custom"),
                   collective_curves=d.get("collective_curves"), kernel_flops=d.get("kernel_flops", {}))
