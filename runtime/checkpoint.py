"""Checkpoints of sharded training state, with orbax-checkpoint.

Each array is written once, by the processes that hold its shards (orbax
coordinates them), not once per rank. A step is finalised atomically: orbax
writes into a temporary folder and renames it when complete, so a save cut off
midway is never taken for a good checkpoint (``latest_step`` ignores it).
Restoring takes target shardings, so a run can resume on another mesh.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from .distributed import initialize


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: Optional[int] = 3):
        initialize()   # (a multi-process run: join it before orbax asks jax for the processes)
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(self.directory,
                                             options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

    def save(self, step: int, state: Any, wait: bool = True) -> None:
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
        target = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x), sharding=s),
            like, shardings)
        return self.manager.restore(step, args=ocp.args.StandardRestore(target))

    def close(self) -> None:
        self.manager.close()
