"""optax on a subset of a table's rows: the optimizer state's leaves shaped like the
table are read and written at those rows only (what Paddle calls a sparse update:
rows a push did not touch keep their state). Tables and states are numpy arrays
updated in place, so a push costs its rows, not the table.

The optimizer runs jitted on the rows padded to a bucket size (rows.bucket): eager
optax on a new row count every push dispatched and compiled op by op, which made a
server's apply ~50 ms a step; padded, a few shapes compile once each."""
from __future__ import annotations

import jax
import numpy as np
import optax

from .rows import bucket


def init_state(optimizer: optax.GradientTransformation, table: np.ndarray):
    return jax.tree.map(lambda leaf: np.array(leaf), optimizer.init(table))


def _is_row_leaf(leaf, rows: int) -> bool:
    return isinstance(leaf, np.ndarray) and leaf.ndim >= 1 and leaf.shape[0] == rows


class RowUpdate:
    """``update(table, state, local_rows, grads)``: the optimizer's step on
    ``table[local_rows]`` (distinct rows) with ``grads``, in place; returns the new state."""

    def __init__(self, optimizer: optax.GradientTransformation):
        def step(rows, grads, sub_state):
            updates, sub_state = optimizer.update(grads, sub_state, rows)
            return optax.apply_updates(rows, updates), sub_state
        self._step = jax.jit(step)

    def __call__(self, table: np.ndarray, state, local_rows: np.ndarray, grads: np.ndarray):
        n, total = len(local_rows), table.shape[0]
        # padding reads row 0 with a zero gradient; what the step makes of it is dropped
        at = np.zeros(bucket(n), np.int64)
        at[:n] = local_rows
        padded = np.zeros((len(at),) + grads.shape[1:], np.float32)
        padded[:n] = grads
        sub_state = jax.tree.map(lambda s: s[at] if _is_row_leaf(s, total) else s, state)
        new_rows, new_sub = self._step(table[at], padded, sub_state)
        table[local_rows] = np.asarray(new_rows)[:n]

        def write(old, new):
            if _is_row_leaf(old, total):
                old[local_rows] = np.asarray(new)[:n]
                return old
            return np.array(new)
        return jax.tree.map(write, state, new_sub)


def init_dense(optimizer, dense: dict):
    return jax.tree.map(lambda leaf: np.array(leaf), optimizer.init(dense))


def dense_step(optimizer):
    """The dense leaves' update, jitted (their shapes never change)."""
    def step(dense, state, grads):
        updates, state = optimizer.update(grads, state, dense)
        return optax.apply_updates(dense, updates), state
    return jax.jit(step)


def apply_dense(step, dense: dict, state, grads: dict):
    new, state = step(dense, state, grads)
    return {k: np.asarray(v) for k, v in new.items()}, state
