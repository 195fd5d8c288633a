"""Training state: which outputs are the inputs of the next step, and the
layouts the data-parallel and optimizer-sharding modes pin.

A training step returns new params and optimizer state with the same structure
as it took them. Tying each such output to its input (same layout out as in)
lets a loop feed them back without re-placing them, and lets jit donate the old
buffers to the new ones.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from ..ir.errors import sharding_error


def _leaf_ranges(args) -> list[range]:
    out, start = [], 0
    for a in args:
        n = len(jax.tree_util.tree_leaves(a))
        out.append(range(start, start + n))
        start += n
    return out


def _dtype(x):
    if not hasattr(x, "dtype"):
        return np.result_type(x)
    # a PRNG key's dtype (key<fry>) is jax's own, not numpy's
    return x.dtype if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else np.dtype(x.dtype)


def leaf_indices(args: Sequence, argnums: Sequence[int]) -> list[int]:
    """The flat input indices of the leaves of arguments ``argnums``."""
    ranges = _leaf_ranges(args)
    return [i for a in argnums if a < len(ranges) for i in ranges[a]]


def state_ties(args: Sequence, argnums: Sequence[int], out_shape) -> dict[int, int]:
    """For each state argument, the output element with the same structure, shapes and
    dtypes (first unused match): {output leaf index: input leaf index}."""
    ranges = _leaf_ranges(args)
    outs = list(out_shape) if isinstance(out_shape, (tuple, list)) else [out_shape]
    out_ranges = _leaf_ranges(outs)
    used, ties = set(), {}
    for a in sorted(set(argnums)):
        sig = jax.tree_util.tree_structure(args[a]), [(tuple(np.shape(x)), _dtype(x))
                                                     for x in jax.tree_util.tree_leaves(args[a])]
        for k, o in enumerate(outs):
            if k in used:
                continue
            osig = jax.tree_util.tree_structure(o), [(tuple(x.shape), _dtype(x))
                                                    for x in jax.tree_util.tree_leaves(o)]
            if osig[0] == sig[0] and osig[1] == sig[1]:
                used.add(k)
                ties.update(zip(out_ranges[k], ranges[a]))
                break
    return ties


def data_parallel_pins(args: Sequence, batch_argnums: Sequence[int], names: list[str], mesh) -> dict:
    """Batch leaves split on dim 0 over every device; every other argument replicated."""
    pins, ranges = {}, _leaf_ranges(args)
    axes = tuple(mesh.axis_names)
    for a, r in enumerate(ranges):
        for i, leaf in zip(r, jax.tree_util.tree_leaves(args[a])):
            shape = np.shape(leaf)
            if a in batch_argnums:
                if not shape or shape[0] % mesh.size:
                    raise sharding_error(
                        f"mode='data_parallel' splits batch input {names[i]} on dim 0 over {mesh.size} devices, but "
                        f"its shape is {shape}", operator="parallelize", shapes=shape,
                        strategy=f"({mesh.size},{', 1' * (len(shape) - 1)})",
                        fix=f"use a global batch size divisible by {mesh.size}, or pass batch_argnums naming "
                            "only the batch arguments")
                pins[i] = ("axes", (axes,) + ((),) * (len(shape) - 1))
            else:
                pins[i] = ("axes", ((),) * len(shape))
    return pins


def optimizer_state_pins(args: Sequence, optimizer_argnums: Sequence[int], mesh, axes: tuple) -> dict:
    """ZeRO-1 / MindSpore optimizer parallel: optimizer-state leaves split on their first
    dim over the data-parallel axes where it divides (others, like step counters, stay whole)."""
    pins, ranges = {}, _leaf_ranges(args)
    n = mesh.axes_size(axes)
    for a in optimizer_argnums:
        for i, leaf in zip(ranges[a], jax.tree_util.tree_leaves(args[a])):
            shape = np.shape(leaf)
            if shape and shape[0] % n == 0:
                pins[i] = ("axes", (tuple(axes),) + ((),) * (len(shape) - 1))
            else:
                pins[i] = ("axes", ((),) * len(shape))
    return pins
