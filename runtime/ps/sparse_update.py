"""optax on a subset of a table's rows: the optimizer state's leaves shaped like the
table are read and written at those rows only (what Paddle calls a sparse update:
rows a push did not touch keep their state). Tables and states are numpy arrays
updated in place, so a push costs its rows, not the table."""
from __future__ import annotations

import jax
import numpy as np
import optax


def init_state(optimizer: optax.GradientTransformation, table: np.ndarray):
    return jax.tree.map(lambda leaf: np.array(leaf), optimizer.init(table))


def _is_row_leaf(leaf, rows: int) -> bool:
    return isinstance(leaf, np.ndarray) and leaf.ndim >= 1 and leaf.shape[0] == rows


def apply_rows(optimizer, table: np.ndarray, state, local_rows: np.ndarray, grads: np.ndarray):
    """Update ``table[local_rows]`` (distinct rows) with ``grads``; returns the new state."""
    n = table.shape[0]
    sub_state = jax.tree.map(lambda s: s[local_rows] if _is_row_leaf(s, n) else s, state)
    current = table[local_rows]
    updates, new_sub = optimizer.update(grads, sub_state, current)
    table[local_rows] = np.asarray(optax.apply_updates(current, updates))

    def write(old, new):
        if _is_row_leaf(old, n):
            old[local_rows] = np.asarray(new)
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
