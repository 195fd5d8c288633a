"""Where a process's inputs go and which ranks' dumps it writes.

Single process: every array is placed with ``jax.device_put``; this process
owns every rank. (The multi-process launcher extends this: each process places
only its addressable shards and writes the dumps of the ranks it owns.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def place(x, sharding, donated: bool = False):
    """Put one global input on the mesh with ``sharding``. A buffer about to be donated
    is copied rather than aliased, so donating never deletes the caller's array unless
    it was already laid out as the step wants (jit's own donation rule)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if donated and isinstance(x, jax.Array):
        # device_put may reuse x's buffer on the device both layouts share, even with
        # may_alias=False (seen on jax 0.10 for replicated targets): copy first.
        x = jnp.copy(x)
    return jax.device_put(x, sharding)


def owned_ranks(mesh_size: int, devices) -> list[int]:
    """Ranks (positions in the mesh's device list) whose dumps this process writes."""
    return list(range(mesh_size))
