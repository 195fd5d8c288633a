"""A NumPy simulation of the ranks of a mesh, independent of the planner: what
every rank holds for a layout, and what each collective does to those holdings."""
from __future__ import annotations

import numpy as np

from shardprop.ir.layout import Layout
from shardprop.ir.mesh import Mesh


def block(x: np.ndarray, layout: Layout, rank: int, mesh: Mesh) -> np.ndarray:
    idx = []
    for size, axes, b in zip(x.shape, layout.dims, layout.block_index(rank, mesh)):
        n = size // mesh.axes_size(axes)
        idx.append(slice(b * n, (b + 1) * n))
    return x[tuple(idx)]


def scatter(x: np.ndarray, layout: Layout, mesh: Mesh, rng: np.random.Generator) -> list[np.ndarray]:
    """Per-rank holdings of global ``x``; along partial axes, random summands
    (or, for max/min partials, values whose max/min is the truth)."""
    out = [block(x, layout, r, mesh).astype(np.float64) for r in range(mesh.size)]
    if not layout.partial:
        return out
    for group in mesh.groups(layout.partial):
        truth = out[group[0]].copy()
        if layout.partial_op == "sum":
            parts = [rng.standard_normal(truth.shape) for _ in group[1:]]
            out[group[0]] = truth - sum(parts)
            for r, p in zip(group[1:], parts):
                out[r] = p
        else:
            sign = 1.0 if layout.partial_op == "max" else -1.0
            for i, r in enumerate(group):
                noise = np.abs(rng.standard_normal(truth.shape)) * sign
                out[r] = truth - noise if i else truth.copy()
            # make the true value win elsewhere too: ranks get random holders of the extreme
            keep = rng.integers(0, len(group), truth.shape)
            for i, r in enumerate(group):
                out[r] = np.where(keep == i, truth, out[r])
    return out


def gather_truth(locals_: list[np.ndarray], layout: Layout, shape, mesh: Mesh) -> list[np.ndarray]:
    """Per rank, the value it represents once partials are combined."""
    if not layout.partial:
        return locals_
    out = list(locals_)
    comb = {"sum": np.sum, "max": np.max, "min": np.min}[layout.partial_op]
    for group in mesh.groups(layout.partial):
        total = comb(np.stack([locals_[r] for r in group]), axis=0)
        for r in group:
            out[r] = total
    return out


def _chunk(x, dim, n, i):
    size = x.shape[dim] // n
    return np.take(x, range(i * size, (i + 1) * size), axis=dim)


def apply(kind: str, params: dict, locals_: list[np.ndarray], mesh: Mesh) -> list[np.ndarray]:
    out = list(locals_)
    if kind == "permute":
        moved = [None] * mesh.size
        for s, d in params["pairs"]:
            moved[d] = locals_[s]
        return moved
    if kind == "slice":
        for r in range(mesh.size):
            x = locals_[r]
            for dim, axes in params["cuts"]:
                x = _chunk(x, dim, mesh.axes_size(axes), mesh.linear_index(r, axes))
            out[r] = x
        return out
    axes = params["axes"]
    for group in mesh.groups(axes):
        xs = [locals_[r] for r in group]
        n = len(group)
        for i, r in enumerate(group):
            if kind == "all_reduce":
                out[r] = {"sum": np.sum, "max": np.max, "min": np.min}[params["op"]](np.stack(xs), axis=0)
            elif kind == "reduce_scatter":
                out[r] = _chunk(np.sum(np.stack(xs), axis=0), params["dim"], n, i)
            elif kind == "all_gather":
                out[r] = np.concatenate(xs, axis=params["dim"])
            elif kind == "all_to_all":
                out[r] = np.concatenate([_chunk(x, params["dst_dim"], n, i) for x in xs], axis=params["src_dim"])
            else:
                raise ValueError(kind)
    return out
