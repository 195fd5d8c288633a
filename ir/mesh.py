"""The device mesh as the compiler sees it: named axes over ranks 0..N-1.

Ranks are laid out row-major over the axes (the last axis varies fastest), the
same convention as MindSpore's device matrix and as ``jax.sharding.Mesh``'s
flattened device array. Nothing here knows about real devices; the runtime maps
rank r to the r-th device of the mesh it builds.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class Mesh:
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    def __post_init__(self):
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(f"mesh has {len(self.axis_names)} axis names but {len(self.axis_sizes)} sizes")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names must be distinct, got {self.axis_names}")
        for name, size in zip(self.axis_names, self.axis_sizes):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes must be positive integers")

    # -- sizes ---------------------------------------------------------------
    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    @cached_property
    def _index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.axis_names)}

    def axis_size(self, axis: str) -> int:
        return self.axis_sizes[self.axis_index(axis)]

    def axis_index(self, axis: str) -> int:
        try:
            return self._index[axis]
        except KeyError:
            raise KeyError(f"mesh has no axis {axis!r}; its axes are {self.axis_names}") from None

    @cached_property
    def _sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    def axes_size(self, axes: Iterable[str]) -> int:
        sizes = self._sizes
        n = 1
        for a in axes:
            try:
                n *= sizes[a]
            except KeyError:
                raise KeyError(f"mesh has no axis {a!r}; its axes are {self.axis_names}") from None
        return n

    def sort_axes(self, axes: Iterable[str]) -> tuple[str, ...]:
        """Axes in mesh order (major first)."""
        return tuple(sorted(set(axes), key=self.axis_index))

    # -- ranks ---------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in reversed(list(zip(self.axis_names, self.axis_sizes))):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.axis_names}

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for name, size in zip(self.axis_names, self.axis_sizes):
            r = r * size + coords[name]
        return r

    def linear_index(self, rank: int, axes: Sequence[str]) -> int:
        """Index of ``rank`` along ``axes`` taken together, ``axes[0]`` major."""
        c = self.coords(rank)
        idx = 0
        for a in axes:
            idx = idx * self.axis_size(a) + c[a]
        return idx

    def group(self, rank: int, axes: Sequence[str]) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only along ``axes``, ordered by their
        index along ``axes`` (``axes[0]`` major): the order a collective over
        ``axes`` concatenates in."""
        base = self.coords(rank)
        members = []
        for combo in itertools.product(*(range(self.axis_size(a)) for a in axes)):
            c = dict(base)
            c.update(zip(axes, combo))
            members.append(self.rank(c))
        return tuple(members)

    def groups(self, axes: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """All rank groups of a collective over ``axes``, ordered by their first rank."""
        seen, out = set(), []
        for r in range(self.size):
            if r not in seen:
                g = self.group(r, axes)
                seen.update(g)
                out.append(g)
        return tuple(out)

    def __str__(self) -> str:
        return " ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.axis_sizes))


def prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def bind_runs(splits: list[int], mesh: Mesh) -> Optional[list[tuple[str, ...]]]:
    """Give each split count the next run of mesh axes whose sizes multiply to it."""
    out, k = [], 0
    for s in splits:
        run, prod = [], 1
        while prod < s and k < len(mesh.axis_names):
            prod *= mesh.axis_sizes[k]
            run.append(mesh.axis_names[k])
            k += 1
        if prod != s:
            return None
        out.append(tuple(run))
    return out
