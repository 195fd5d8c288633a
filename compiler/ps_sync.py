"""Synchronous parameter-server training as one SPMD program (``sp.ps.sync``).

"Servers hold the tables" becomes: every embedding table is split by rows over the
devices, and everything else is derived by ``parallelize``: the lookup happens where
the rows live (each device looks up the ids it owns and the partial result is
reduced, passes/rules/indexing.py), the table's gradient is scatter-added into the
owned rows only, and the dense part runs data parallel (its gradients all-reduced).
Nothing table-sized is ever gathered or reduced.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import jax
import numpy as np

from ..ir.errors import ShardingError, sharding_error
from ..runtime.mesh import resolve_mesh
from .source_lines import caller_source


def mesh_devices(mesh) -> int:
    """How many devices a ``parallelize`` mesh argument names."""
    return len(resolve_mesh(mesh).devices)


def check_tables(params, tables: Mapping, devices: Optional[int], *, operator: str, source=None) -> None:
    """Every table is a top-level entry of the params dict, with rows that divide over
    the devices when it is split by rows over them (``devices``; None: not split)."""
    if not isinstance(params, Mapping):
        raise sharding_error("the parameters must be a dict whose top-level entries include the tables",
                             operator=operator, source=source, shapes=type(params).__name__,
                             fix="keep the embedding tables as top-level entries of a params dict")
    for name in tables:
        if name not in params:
            raise sharding_error(f"table {name!r} is not a top-level entry of the parameters "
                                 f"(they have {sorted(params)})", operator=operator, source=source,
                                 fix="name the tables by their keys in the params dict")
        shape = tuple(np.shape(params[name]))
        if len(shape) < 1:
            raise sharding_error(f"table {name!r} is a scalar; a table has rows", operator=operator, source=source,
                                 shapes={name: shape}, fix="name only embedding tables ([rows, ...] arrays)")
        if devices and shape[0] % devices:
            padded = -(-shape[0] // devices) * devices
            raise sharding_error(
                f"table {name!r} has {shape[0]:,} rows, which do not split evenly over {devices} "
                f"devices (each device holds an equal block of rows)", operator=operator, source=source,
                shapes={name: shape}, strategy={name: (devices,) + (1,) * (len(shape) - 1)},
                fix=f"pad the table to {padded:,} rows (sp.ps.pad_rows(table, {devices})); ids never reach the "
                    f"padding, so the model computes the same")


def pad_rows(table, multiple: int):
    """``table`` with zero rows appended so that its row count is a multiple of ``multiple``."""
    table = np.asarray(table)
    extra = -table.shape[0] % multiple
    return np.concatenate([table, np.zeros((extra,) + table.shape[1:], table.dtype)]) if extra else table


def row_split(x, devices: int) -> tuple:
    """Split counts: rows over every device, other dims whole."""
    return (devices,) + (1,) * (np.ndim(x) - 1)


def batch_split(batch, devices: int):
    """Split counts for every leaf of a batch: dim 0 over every device."""
    return jax.tree_util.tree_map(lambda x: row_split(x, devices), batch)


class SyncStep:
    """``step(params, opt_state, batch) -> (params, opt_state, ...)`` run as one SPMD
    program with the tables split by rows and the batch split over the devices;
    params and optimizer state are donated and come back in their layouts. The
    optimizer state of a table (momentum, Adam's moments) follows the table's rows,
    derived like everything else."""

    def __init__(self, step: Callable, *, mesh, tables, **parallelize_kwargs):
        from .api import parallelize
        self.step = step
        self.tables = tuple(tables)
        self.devices = mesh_devices(mesh)
        self.source = caller_source()
        self._kwargs = dict(mesh=mesh, donate_argnums=(0, 1), **parallelize_kwargs)
        self._parallelize = parallelize
        self._fn: Optional[Callable] = None

    def _compiled(self, params, opt_state, batch):
        if self._fn is None:
            check_tables(params, self.tables, self.devices, operator="sp.ps.sync", source=self.source)
            param_strategy = {k: (row_split(v, self.devices) if k in self.tables else None) for k, v in params.items()}
            in_strategy = (param_strategy, None, batch_split(batch, self.devices))
            self._fn = self._parallelize(self.step, in_strategy=in_strategy, **self._kwargs)
        return self._fn

    def __call__(self, params, opt_state, batch):
        return self._compiled(params, opt_state, batch)(params, opt_state, batch)

    def plan(self, params, opt_state, batch):
        return self._compiled(params, opt_state, batch).plan(params, opt_state, batch)


def sync(step: Callable, *, mesh, tables, **parallelize_kwargs) -> SyncStep:
    """Synchronous parameter-server training of ``step(params, opt_state, batch)``:
    ``tables`` names the params dict's embedding tables (split by rows over the mesh's
    devices, the servers); the batch (every leaf) is split on dim 0; the rest is
    derived. Steps equal one device's."""
    if isinstance(tables, str):
        raise ShardingError(f"sp.ps.sync: tables={tables!r} should be a collection of table names, e.g. ({tables!r},)")
    return SyncStep(step, mesh=mesh, tables=tables, **parallelize_kwargs)
