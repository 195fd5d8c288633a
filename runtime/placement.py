"""Where a process's inputs go and which ranks' dumps it writes.

One process: arrays are placed with ``jax.device_put``. Several processes: a
host array holding the global value is cut into this process's shards
(``jax.make_array_from_callback``), since jit rejects a NumPy input whose
sharding spans processes; and each process writes the per-rank dumps of the
ranks whose devices it owns, so together they write what one process would.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def place(x, sharding, donated: bool = False):
    """Put one global input on the mesh with ``sharding``. A buffer about to be donated
    is copied rather than aliased, so donating never deletes the caller's array unless
    it was already laid out as the step wants (jit's own donation rule)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if not sharding.is_fully_addressable:
        host = np.asarray(x) if not isinstance(x, jax.Array) or x.is_fully_addressable else None
        if host is None:
            raise ValueError("an input spread over several processes must arrive in the layout the step wants; "
                             "use ParallelFunction.input_shardings to build it")
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    if donated and isinstance(x, jax.Array):
        # device_put may reuse x's buffer on the device both layouts share, even with
        # may_alias=False (seen on jax 0.10 for replicated targets): copy first.
        x = jnp.copy(x)
    return jax.device_put(x, sharding)


def owned_ranks(mesh_size: int, devices) -> list[int]:
    """Ranks (positions in the mesh's device list) whose devices belong to this process."""
    me = jax.process_index()
    return [r for r in range(mesh_size) if devices[r].process_index == me]


def writes_global_files() -> bool:
    """The per-pass files and the summary are the same for all: process 0 writes them."""
    return jax.process_index() == 0
