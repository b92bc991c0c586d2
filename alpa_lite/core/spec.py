"""Sharding specs in Alpa notation (Zheng et al., OSDI'22, section 4.1).

A spec holds one entry per tensor dim: the mesh axes that split the dim, in major-to-minor
order. ``()`` is ``R`` (replicated), ``(0,)`` is ``S0``, ``(1,)`` is ``S1`` and ``(0, 1)`` is
``S01`` (split over both axes, axis 0 major: device ``(i, j)`` holds chunk ``i * n1 + j``).
Written together a ``[B, H]`` activation split by batch on axis 0 is ``S0R``.

DTensor equivalence: ``S0R`` on a 2D mesh is ``(Shard(0), Replicate())`` and ``S01R`` is
``(Shard(0), Shard(0))``.

A value may also be a *partial sum* along some mesh axes (DTensor's ``Partial``): every device
of such an axis holds a tensor of the local shape, and the value is their sum. The notation
appends ``P`` and those axes: ``RRP1`` is a ``[B, H]`` value whose pieces along axis 1 sum to
it (a row-parallel linear's result before its all-reduce); ``S0RP1`` is that, split by batch on
axis 0. An axis is never both split and partial.
"""
from __future__ import annotations

import math
import re

_ENTRY = re.compile(r"R|S01|S10|S0|S1")
_PARTIAL = re.compile(r"P(01|0|1)$")
_NAMES = {(): "R", (0,): "S0", (1,): "S1", (0, 1): "S01"}


def _parse(text: str) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    m = _PARTIAL.search(text)
    partial = tuple(map(int, m.group(1))) if m else ()
    body = text[:m.start()] if m else text
    entries = _ENTRY.findall(body)
    if "".join(entries) != body:
        raise ValueError(f"not a sharding spec: {text!r} (expected e.g. 'S0R', 'RS01', 'S0RP1')")
    if "S10" in entries:
        raise ValueError(f"S10 is not supported (use S01, axis 0 major): {text!r}")
    table = {v: k for k, v in _NAMES.items()}
    return tuple(table[e] for e in entries), partial


class ShardingSpec(str):
    """Per-dim mesh axes of one tensor (``dims``) and the mesh axes it is a partial sum along
    (``partial``, sorted), written in Alpa notation.

    A spec is its notation: ``ShardingSpec("S0R")`` is the string ``"S0R"`` (so it prints, compares,
    hashes and serializes to JSON as that string) that also carries the parsed ``dims``
    (``((0,), ())``) and the methods below; ``ShardingSpec(((0,), ()))`` builds the same spec
    from its dims (``ShardingSpec(((0,), ()), partial=(1,))`` is ``S0RP1``). Parsing happens
    once, where a spec enters (a plan file, a user option).

    Raises:
        ValueError: text that is not a sequence of R / S0 / S1 / S01 with an optional P0 / P1 /
            P01 at the end, a mesh axis used twice, or an axis both split and partial.
    """

    dims: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...]

    def __new__(cls, dims: str | tuple[tuple[int, ...], ...], partial: tuple[int, ...] = ()) -> "ShardingSpec":
        if isinstance(dims, ShardingSpec) and not partial:
            return dims
        if isinstance(dims, str):
            dims, partial = _parse(dims)
        dims = tuple(tuple(entry) for entry in dims)
        partial = tuple(sorted(set(partial)))
        used = [a for entry in dims for a in entry]
        if len(used) != len(set(used)):
            raise ValueError(f"a mesh axis may split only one tensor dim: {dims}")
        if set(used) & set(partial) or not set(partial) <= {0, 1}:
            raise ValueError(f"partial axes {partial} must be mesh axes 0 / 1 that split no dim of {dims}")
        for entry in dims:
            if entry not in _NAMES:
                raise ValueError(f"unsupported dim entry {entry}; use R, S0, S1 or S01")
        text = "".join(_NAMES[e] for e in dims) + ("P" + "".join(map(str, partial)) if partial else "")
        spec = super().__new__(cls, text)
        spec.dims, spec.partial = dims, partial
        return spec

    def __reduce__(self):
        return ShardingSpec, (self.dims, self.partial)

    @classmethod
    def replicated(cls, ndim: int) -> "ShardingSpec":
        return cls(((),) * ndim)

    @classmethod
    def parse(cls, text: str) -> "ShardingSpec":
        """Parse ``"S0R"``, ``"RS01"`` ... ; ``""`` is the spec of a scalar.

        Raises:
            ValueError: on text that is not a sequence of R / S0 / S1 / S01.
        """
        return cls(text)

    def __repr__(self) -> str:
        return f"ShardingSpec({str(self)!r})"

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def axes(self) -> set[int]:
        """Mesh axes that split some dim."""
        return {a for entry in self.dims for a in entry}

    def dim_of_axis(self, axis: int) -> int | None:
        """The tensor dim split along mesh ``axis``, or None when replicated along it."""
        for d, entry in enumerate(self.dims):
            if axis in entry:
                return d
        return None

    def shards(self, dim: int, mesh_shape: tuple[int, ...]) -> int:
        """Number of pieces dim ``dim`` is cut into on a mesh of ``mesh_shape``."""
        return math.prod(mesh_shape[a] for a in self.dims[dim])

    def divides(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
        """True when every split dim divides evenly (the only specs alpa-lite uses)."""
        return len(shape) == self.ndim and all(
            size % self.shards(d, mesh_shape) == 0 for d, size in enumerate(shape))

    def local_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one device's shard of a tensor of global ``shape``.

        Raises:
            ValueError: when a split dim does not divide evenly.
        """
        if not self.divides(shape, mesh_shape):
            raise ValueError(f"spec {self} does not divide shape {tuple(shape)} on mesh {mesh_shape}")
        return tuple(size // self.shards(d, mesh_shape) for d, size in enumerate(shape))

    def placements(self, mesh_ndim: int = 2) -> tuple:
        """The DTensor placements of this spec on a ``mesh_ndim``-D ``DeviceMesh``: per mesh axis,
        ``Shard(d)`` for the tensor dim ``d`` it splits, ``Partial()`` along a partial axis, else
        ``Replicate()``. ``S01`` on dim ``d``
        is ``(Shard(d), Shard(d))``: DTensor splits along mesh dim 0 first, then each piece along
        mesh dim 1, which is Alpa's axis-0-major order (``torch.distributed.tensor``)."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        return tuple(Partial() if a in self.partial else Shard(d) if d is not None else Replicate()
                     for a, d in enumerate(map(self.dim_of_axis, range(mesh_ndim))))

    def with_dim(self, dim: int, entry: tuple[int, ...]) -> "ShardingSpec":
        dims = list(self.dims)
        dims[dim] = entry
        return ShardingSpec(tuple(dims), self.partial)

    def with_partial(self, partial: tuple[int, ...]) -> "ShardingSpec":
        """The same dims, a partial sum along ``partial`` (``()``: the plain value)."""
        return ShardingSpec(self.dims, partial)
