"""Where a process's inputs go and which ranks' dumps it writes.

Single process: every array is placed with ``jax.device_put``; this process
owns every rank. (The multi-process launcher extends this: each process places
only its addressable shards and writes the dumps of the ranks it owns.)
"""
from __future__ import annotations

import jax


def place(x, sharding):
    """Put one global input on the mesh with ``sharding``."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def owned_ranks(mesh_size: int, devices) -> list[int]:
    """Ranks (positions in the mesh's device list) whose dumps this process writes."""
    return list(range(mesh_size))
