"""How one tensor is spread over the mesh.

``dims[d]`` is the ordered tuple of mesh axes that split tensor dimension ``d``
(major to minor): with ``dims[1] == ("a1", "a2")`` the dimension is cut into
``|a1| * |a2|`` contiguous blocks and the rank with coordinates ``(i, j)`` on
``(a1, a2)`` holds block ``i * |a2| + j``. Axes that appear in no dim replicate
the tensor, except those in ``partial``: along them every rank holds a summand
(or a max/min candidate, by ``partial_op``) of the true value.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from .mesh import Mesh

PARTIAL_OPS = ("sum", "max", "min")


@dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    partial_op: str = "sum"

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(tuple(d) for d in self.dims))
        object.__setattr__(self, "partial", tuple(self.partial))
        if self.partial_op not in PARTIAL_OPS:
            raise ValueError(f"partial_op must be one of {PARTIAL_OPS}, got {self.partial_op!r}")
        if not self.partial:
            object.__setattr__(self, "partial_op", "sum")

    @staticmethod
    def replicated(rank: int) -> "Layout":
        return Layout(((),) * rank)

    @property
    def rank(self) -> int:
        return len(self.dims)

    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    def used_axes(self) -> set[str]:
        return set(self.sharded_axes()) | set(self.partial)

    def is_replicated(self) -> bool:
        return not self.partial and not self.sharded_axes()

    def without_partial(self) -> "Layout":
        return Layout(self.dims)

    def with_dim(self, d: int, axes: Sequence[str]) -> "Layout":
        dims = list(self.dims)
        dims[d] = tuple(axes)
        return Layout(tuple(dims), self.partial, self.partial_op)

    def splits(self, mesh: Mesh) -> tuple[int, ...]:
        """Split count per dim: the MindSpore view of this layout."""
        return tuple(mesh.axes_size(d) for d in self.dims)

    def local_shape(self, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
        return tuple(s // mesh.axes_size(d) for s, d in zip(shape, self.dims))

    def block_index(self, rank: int, mesh: Mesh) -> tuple[int, ...]:
        return tuple(mesh.linear_index(rank, d) for d in self.dims)

    def offsets(self, rank: int, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
        local = self.local_shape(shape, mesh)
        return tuple(i * n for i, n in zip(self.block_index(rank, mesh), local))

    def fits(self, shape: tuple, mesh: Mesh) -> bool:
        return _fits(self, tuple(shape), mesh)

    def problems(self, shape: Sequence[int], mesh: Mesh) -> list[str]:
        """Why this layout cannot hold a tensor of ``shape`` on ``mesh`` (empty if it can)."""
        out = []
        if len(shape) != self.rank:
            return [f"layout has {self.rank} dims but the tensor has {len(shape)}"]
        seen = []
        for a in self.sharded_axes() + self.partial:
            if a not in mesh.axis_names:
                out.append(f"unknown mesh axis {a!r} (mesh axes: {', '.join(mesh.axis_names)})")
            elif a in seen:
                out.append(f"mesh axis {a!r} is used twice")
            seen.append(a)
        if out:
            return out
        for d, (size, axes) in enumerate(zip(shape, self.dims)):
            n = mesh.axes_size(axes)
            if size % n:
                out.append(f"dim {d} of size {size} is not divisible by its split count {n}")
        return out

    def __str__(self) -> str:
        body = "[" + ", ".join("{" + ",".join(d) + "}" for d in self.dims) + "]"
        if self.partial:
            body += f" partial_{self.partial_op}{{{','.join(self.partial)}}}"
        return body


@lru_cache(maxsize=65536)
def _fits(layout: Layout, shape: tuple, mesh: Mesh) -> bool:
    return not layout.problems(shape, mesh)
