"""GEO parameter-server training (k-step delta averaging) as one SPMD program.

``sp.ps.geo(step, k_steps=k, mesh=n, tables=...)`` runs ``step`` on every data-parallel
replica for k steps from the same parameters, then averages what each replica changed
(its delta) and applies it: Paddle's GEO-SGD, the scheme local SGD and DiLoCo
generalize. Nothing here is a loop around single-device code: one round is written
in the global view, with a leading replica axis on the per-replica state,

    local params [R, ...]  = broadcast(params)            (R = number of replicas)
    local state, losses    = vmap over R of (k steps of ``step``, a lax.scan)
    params                += mean over R of (local params - params)

and ``parallelize`` is told only that the replica axis and the batch are split over
the devices. The rest is derived: the k local steps run without communication, and
the mean over a split axis is a partial sum, so the averaging is an all_reduce, once
per round.

A sparse table moves only the rows a replica touched. The round's distinct ids per
replica are found on the host from the batches (the worker's bookkeeping in a
parameter server), padded with an id no row has to a power of two (or to every id
looked up, if fewer) that only grows, so that rounds share one compiled program.
The averaged delta is written as a scatter-add of each replica's touched rows into
the table. Either every
replica's rows travel to every replica (an all_gather of ids and rows: small k,
few rows), or each replica adds its own rows into a zero table and the tables are
summed (an all_reduce of the table: large k, when most rows are touched anyway).
Which one is decided here by their bytes and written as a ``shard()`` mark on that
scatter-add (the propagation does not offer the gathered form by itself when every
neighbour holds the rows split); the collectives are derived from the mark. A
table's rows must change only where the round's steps look them up: plain SGD or
Adagrad on the tables, not momentum, Adam or weight decay, which move rows nobody
looked up (that motion would be lost; give such optimizers no ``tables``, and every
parameter is averaged densely).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from ..ir.errors import ShardingError, sharding_error
from .annotate import shard
from .source_lines import caller_source
from .ps_sync import check_tables, mesh_devices, row_split

IdsOf = Union[str, Callable[[Any], Any]]   # a batch field's name, or batch -> ids


class GeoState(NamedTuple):
    """What GEO carries between rounds: the synchronized parameters (every replica
    starts a round from them) and each replica's own optimizer state (a leading
    replica axis on every leaf, split over the devices)."""
    params: Any
    opt_state: Any


class GeoStep:
    """One GEO round per call: ``state, losses = geo(state, batches)`` where every
    leaf of ``batches`` is [k_steps, global batch, ...]; replica r trains on its
    slice r of each global batch. ``losses[i]`` is the replicas' mean loss at local
    step i."""

    def __init__(self, step: Callable, *, k_steps: int, mesh, tables: Optional[Mapping[str, IdsOf]] = None,
                 **parallelize_kwargs):
        source = caller_source()
        if isinstance(k_steps, bool) or not isinstance(k_steps, (int, np.integer)) or k_steps < 1:
            raise sharding_error(f"k_steps={k_steps!r}: every replica trains k_steps local steps between "
                                 f"synchronizations, so it must be an integer of at least 1",
                                 operator="sp.ps.geo", source=source,
                                 fix="k_steps=1 is synchronous training; Paddle's GEO default is k_steps=100")
        self.step = step
        self.k_steps = int(k_steps)
        self.tables = dict(tables or {})
        self.replicas = mesh_devices(mesh)
        self.source = source
        self._mesh = mesh
        self._kwargs = parallelize_kwargs
        self._fn = None
        self._buckets: dict = {}  # table -> rows pushed per replica (a power of two, only grows)
        self.pushes: dict = {}   # table -> "rows" (touched rows gathered) or "table" (table summed), once traced

    # -- state ----------------------------------------------------------------------
    def init(self, params, opt_state) -> GeoState:
        """The starting state: ``params`` and one copy of ``opt_state`` per replica."""
        if self.tables:   # each replica holds whole tables: any row count will do
            check_tables(params, self.tables, None, operator="sp.ps.geo", source=self.source)
        copies = jax.tree_util.tree_map(
            lambda x: np.broadcast_to(np.asarray(x), (self.replicas,) + np.shape(x)).copy(), opt_state)
        return GeoState(params, copies)

    # -- the round, in the global view --------------------------------------------------
    def _ids(self, batch, name):
        how = self.tables[name]
        return batch[how] if isinstance(how, str) else how(batch)

    def _check_batches(self, batches) -> None:
        R, k = self.replicas, self.k_steps
        for x in jax.tree_util.tree_leaves(batches):
            if np.ndim(x) < 2 or np.shape(x)[0] != k:
                raise sharding_error(f"every leaf of the batches needs k_steps={k} batches on its first dim",
                                     operator="sp.ps.geo", source=self.source, shapes=tuple(np.shape(x)),
                                     fix=f"stack {k} batches: jax.tree.map(lambda *b: np.stack(b), *batches)")
            if np.shape(x)[1] % R:
                raise sharding_error(f"the global batch must divide over the {R} replicas",
                                     operator="sp.ps.geo", source=self.source, shapes=tuple(np.shape(x)),
                                     fix=f"use a global batch size that is a multiple of {R}")

    def _touched(self, params, batches) -> dict:
        """Per table, each replica's distinct looked-up rows this round: int32 [R, U],
        padded with the table's row count (an id no row has)."""
        R, out = self.replicas, {}
        for name in self.tables:
            ids = np.asarray(self._ids(batches, name))
            k, n = ids.shape[:2]
            per_replica = np.swapaxes(ids.reshape((k, R, n // R) + ids.shape[2:]), 0, 1).reshape(R, -1)
            distinct = [np.unique(r) for r in per_replica]
            most = max(len(d) for d in distinct)
            # a power of two, at most every id the replica looked up, and never smaller than before
            bucket = min(1 << max(0, most - 1).bit_length(), per_replica.shape[1])
            bucket = self._buckets[name] = max(self._buckets.get(name, 1), bucket)
            rows = np.shape(params[name])[0]
            touched = np.full((R, bucket), rows, np.int32)
            for r, d in enumerate(distinct):
                touched[r, :len(d)] = d
            out[name] = touched
        return out

    def _round(self, params, opt_leaves, batches, touched):
        R, k = self.replicas, self.k_steps
        opt_state = jax.tree_util.tree_unflatten(self._opt_tree, opt_leaves)

        def to_replicas(x):   # [k, R * b, ...] -> [R, k, b, ...]: replica r reads slice r of each batch
            return jnp.swapaxes(x.reshape((k, R, x.shape[1] // R) + x.shape[2:]), 0, 1)
        local_batches = jax.tree_util.tree_map(to_replicas, batches)
        local_params = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (R,) + jnp.shape(x)), params)

        def replica(p, o, bs):
            def one_step(carry, batch):
                out = self.step(carry[0], carry[1], batch)
                return (out[0], out[1]), out[2]
            (p, o), losses = lax.scan(one_step, (p, o), bs)
            return p, o, losses
        trained, opt_state, losses = jax.vmap(replica)(local_params, opt_state, local_batches)

        def average(anchor, local):
            return anchor + jnp.mean(local - anchor, axis=0)
        if self.tables:
            merged = {}
            for name, anchor in params.items():
                if name in self.tables:
                    gathered = push_rows(anchor.shape, anchor.dtype.itemsize, touched[name].shape[1], R)
                    self.pushes[name] = "rows" if gathered else "table"
                    merged[name] = _merge_rows(anchor, trained[name], touched[name], gathered)
                else:
                    merged[name] = jax.tree_util.tree_map(average, anchor, trained[name])
        else:
            merged = jax.tree_util.tree_map(average, params, trained)
        return merged, jax.tree_util.tree_leaves(opt_state), jnp.mean(losses, axis=0)

    # -- compile and run ---------------------------------------------------------------
    def _compiled(self, state: GeoState, batches):
        if self._fn is None:
            from .api import parallelize
            R = self.replicas
            replicated = jax.tree_util.tree_map(lambda x: PartitionSpec(), state.params)
            # the optimizer state travels as a list of leaves (its own containers are
            # optax NamedTuples; a flat list keeps the in_strategy prefix plain)
            per_replica = [row_split(x, R) for x in jax.tree_util.tree_leaves(state.opt_state)]
            batch_split = jax.tree_util.tree_map(lambda x: (1, R) + (1,) * (np.ndim(x) - 2), batches)
            touched_split = {name: (R, 1) for name in self.tables}
            self._fn = parallelize(self._round, mesh=self._mesh, donate_argnums=(0, 1),
                                   in_strategy=(replicated, per_replica, batch_split, touched_split), **self._kwargs)
        return self._fn

    def _args(self, state: GeoState, batches) -> tuple:
        self._check_batches(batches)
        leaves, self._opt_tree = jax.tree_util.tree_flatten(state.opt_state)
        return state.params, leaves, batches, self._touched(state.params, batches)

    def __call__(self, state: GeoState, batches):
        params, opt_leaves, losses = self._compiled(state, batches)(*self._args(state, batches))
        return GeoState(params, jax.tree_util.tree_unflatten(self._opt_tree, opt_leaves)), losses

    def plan(self, state: GeoState, batches):
        return self._compiled(state, batches).plan(*self._args(state, batches))

    def bytes_per_sample(self, state: GeoState, batches) -> float:
        """Bytes each device sends per training sample (the plan's collectives over one
        round, divided by the round's k_steps x global batch samples)."""
        samples = self.k_steps * jax.tree_util.tree_leaves(batches)[0].shape[1]
        return sum(c.bytes for c in self.plan(state, batches).collectives) / samples


def push_rows(table_shape, itemsize: int, touched: int, replicas: int) -> bool:
    """Whether pushing every replica's ``touched`` rows (with their ids) moves fewer
    bytes per device than summing the whole table (ring formulas: an all_gather sends
    (n-1)/n of the gathered data, an all_reduce twice that of the table)."""
    row = int(np.prod(table_shape[1:], dtype=np.int64)) * itemsize
    gather = (replicas - 1) / replicas * replicas * touched * (row + 4)
    reduce = 2 * (replicas - 1) / replicas * table_shape[0] * row
    return gather < reduce


def _add_rows(table, ids, rows, replicas: int, gathered: bool):
    """table.at[ids].add(rows) (ids past the end dropped), marked: rows whole (gathered to
    every replica) or split by replica (a partial table per replica, then summed)."""
    whole = lambda x: (1,) * x.ndim  # noqa: E731
    split = lambda x: (replicas,) + (1,) * (x.ndim - 1)  # noqa: E731
    strategy = (whole(table), whole(ids), whole(rows)) if gathered else (whole(table), split(ids), split(rows))
    return shard(lambda t, i, r: t.at[i].add(r, mode="drop"), strategy)(table, ids, rows)


def _merge_rows(anchor, local, touched, gathered: bool):
    """``anchor`` plus the replicas' mean delta on the rows they touched.
    anchor [V, ...], local [R, V, ...] (each replica's trained copy), touched [R, U]
    (distinct rows per replica, padded with V: looked up as zeros, dropped when added)."""
    R = local.shape[0]
    mine = jax.vmap(lambda t, i: t.at[i].get(mode="fill", fill_value=0))(local, touched)   # [R, U, ...]
    delta = mine - anchor.at[touched].get(mode="fill", fill_value=0)
    rows = (delta / R).reshape((-1,) + anchor.shape[1:])
    return _add_rows(anchor, touched.reshape(-1), rows, R, gathered)


def geo(step: Callable, *, k_steps: int, mesh, tables: Optional[Mapping[str, IdsOf]] = None,
        **parallelize_kwargs) -> GeoStep:
    """GEO training of ``step(params, opt_state, batch) -> (params, opt_state, loss)``
    over ``mesh``'s devices, one replica per device: each trains ``k_steps`` local
    steps, then the replicas' parameter deltas are averaged and applied.

    tables: the params dict's embedding tables, each with the batch field of its ids
        (or a function of the batch returning them): only the rows a replica looked up
        are pushed. Without it every parameter is averaged densely.

    ``state = g.init(params, opt_state)``; ``state, losses = g(state, batches)`` with
    batches [k_steps, global batch, ...]; ``state.params`` are the synchronized
    parameters. With plain SGD, k_steps=1 is synchronous training.
    """
    if tables is not None and (isinstance(tables, str) or not isinstance(tables, Mapping)):
        raise ShardingError(f"sp.ps.geo: tables={tables!r} should map each table's name to the batch field of its "
                            f"ids, e.g. {{'emb': 'ids'}}")
    return GeoStep(step, k_steps=k_steps, mesh=mesh, tables=tables, **parallelize_kwargs)
