"""Checkpoints of sharded training state, with orbax-checkpoint.

Each array is written once, by the processes that hold its shards (orbax
coordinates them), not once per rank. A step is finalised atomically: orbax
writes into a temporary folder and renames it when complete, so a save cut off
midway is never taken for a good checkpoint (``latest_step`` ignores it).
Restoring takes target shardings, so a run can resume on another mesh.

An array of a multi-process run whose devices all belong to one process (a pipeline
rank's state under ``lowering="mpmd"``) is written from host memory: orbax writes an
array from the shards each process holds and refuses one that a process holds whole.
Such an array is gathered to every process (``to_numpy``) and written once; restored,
it is placed on its devices by the process that owns them.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from .distributed import initialize, to_numpy


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: Optional[int] = 3):
        initialize()   # (a multi-process run: join it before orbax asks jax for the processes)
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(self.directory,
                                             options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

    def save(self, step: int, state: Any, wait: bool = True) -> None:
        state = jax.tree_util.tree_map(lambda x: to_numpy(x) if _on_one_process(getattr(x, "sharding", None)) else x,
                                       state)
        self.manager.save(step, args=ocp.args.StandardSave(state))
        if wait:
            self.manager.wait_until_finished()

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def restore(self, like: Any, step: Optional[int] = None, shardings: Any = None) -> Any:
        """Restore ``step`` (default: the latest complete one) shaped like ``like``; with
        ``shardings`` (a pytree like ``like``), each array lands in that layout."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        if shardings is None:
            shardings = jax.tree_util.tree_map(lambda x: getattr(x, "sharding", None), like)
        def target(x, s):
            shape, dtype = jax.numpy.shape(x), jax.numpy.result_type(x)
            # (written from host memory by ``save``: read back as such, placed below)
            return np.empty(shape, dtype) if _on_one_process(s) else jax.ShapeDtypeStruct(shape, dtype, sharding=s)
        got = self.manager.restore(step, args=ocp.args.StandardRestore(jax.tree_util.tree_map(target, like, shardings)))
        return jax.tree_util.tree_map(lambda x, s: _placed(x, s) if _on_one_process(s) else x, got, shardings)

    def close(self) -> None:
        self.manager.close()


def _on_one_process(sharding) -> bool:
    """Whether ``sharding`` (of a multi-process run) lies on the devices of one process."""
    return sharding is not None and jax.process_count() > 1 and \
        len({d.process_index for d in sharding.device_set}) == 1


def _placed(value: np.ndarray, sharding):
    """``value`` under ``sharding``: on this process's devices, or, where they are another
    process's, the global array that names them and holds no block here."""
    if any(d.process_index == jax.process_index() for d in sharding.device_set):
        return jax.device_put(value, sharding)
    return jax.make_array_from_single_device_arrays(value.shape, sharding, [], dtype=value.dtype)
