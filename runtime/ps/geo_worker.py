"""GEO on Ray (Paddle's ``a_sync_configs={"k_steps": k}``): a worker trains k local
steps on its own copy of the rows it uses and of the dense leaves, then pushes only
the change (its delta, divided by the number of workers, so the servers hold the
workers' average) for the rows it touched, and starts the next round from the
servers' current values. The servers add deltas as they arrive (server mode "geo").

Rows are pulled the first time a round's batch needs them; the optimizer runs on the
worker. A table's optimizer must keep no per-row state (plain SGD): state for rows
would have to live across rounds on a worker that only sees some rows."""
from __future__ import annotations

import time

import numpy as np
import optax

from .layout import join_params, owners
from .rows import BatchRows
from .worker import Worker


class RowCache:
    """One table's rows pulled this round: where each id sits (a slot per table row,
    -1 when not pulled: constant-time lookups however many rows a round touches), the
    values as pulled and the values now (grown by doubling)."""

    def __init__(self, rows: int):
        self.slot = np.full(rows, -1, np.int64)
        self.ids = np.zeros(0, np.int64)
        self.base = self.cur = None
        self.size = 0

    def missing(self, ids: np.ndarray) -> np.ndarray:
        return ids[self.slot[ids] < 0]

    def add(self, ids: np.ndarray, rows: np.ndarray) -> None:
        n = len(ids)
        if not n:
            return
        if self.base is None:
            self.base = np.empty((max(n, 1024),) + rows.shape[1:], np.float32)
            self.cur = np.empty_like(self.base)
            self.ids = np.empty(len(self.base), np.int64)
        while self.size + n > len(self.base):
            grow = len(self.base)
            self.base = np.concatenate([self.base, np.empty_like(self.base[:grow])])
            self.cur = np.concatenate([self.cur, np.empty_like(self.cur[:grow])])
            self.ids = np.concatenate([self.ids, np.empty(grow, np.int64)])
        end = self.size + n
        self.ids[self.size:end] = ids
        self.base[self.size:end] = rows
        self.cur[self.size:end] = rows
        self.slot[ids] = np.arange(self.size, end)
        self.size = end

    def positions(self, ids: np.ndarray) -> np.ndarray:
        return self.slot[ids]

    def touched(self) -> tuple:
        """(ids, current values, values as pulled) of every row pulled this round."""
        return self.ids[:self.size], self.cur[:self.size], self.base[:self.size]

    def clear(self) -> None:
        self.slot[self.ids[:self.size]] = -1
        self.size = 0


def check_stateless(optimizer, table_dim=(1,)) -> None:
    probe = np.zeros((3,) + tuple(table_dim), np.float32)
    import jax
    leaves = [x for x in jax.tree.leaves(optimizer.init(probe)) if np.ndim(x) >= 1]
    if leaves:
        raise ValueError("GEO trains on each worker's copy of the rows it used; the optimizer keeps per-row state "
                         "(momentum, Adam's moments), which no worker holds for every row: use plain SGD "
                         "(optax.sgd) for GEO")


class GeoWorker(Worker):
    def __init__(self, *args, k_steps: int, **kwargs):
        self.k_steps = self.check_k_steps(k_steps)
        super().__init__(*args, **kwargs)

    @staticmethod
    def check_k_steps(k_steps) -> int:
        if isinstance(k_steps, bool) or not isinstance(k_steps, (int, np.integer)) or k_steps < 1:
            raise ValueError(f"k_steps={k_steps!r}: each GEO worker trains k_steps local steps between pushes, so "
                             f"it must be an integer of at least 1 (1 = push every step)")
        return int(k_steps)

    def reset(self, delay_factor: float = 1.0, optimizer=None) -> None:
        super().reset(delay_factor, optimizer)
        self.round_step = 0
        self.opt_state = self.optimizer.init(self.template)   # no per-row state (check_stateless)

    def _begin_round(self) -> None:
        pulled = self._call("pull", [({}, True) for _ in self.servers])
        self.versions = [v for v, _, _ in pulled]
        self.dense_base = {}
        for _, d, _ in pulled:
            self.dense_base.update(d)
        self.dense_cur = {k: np.array(v) for k, v in self.dense_base.items()}
        if not hasattr(self, "caches"):
            self.caches = {t: RowCache(int(b[-1])) for t, b in self.layout.table_bounds.items()}
        for cache in self.caches.values():
            cache.clear()
        self.round_samples = 0
        self.stats["bytes_pulled"] += sum(a.nbytes for a in self.dense_base.values())

    def step(self) -> dict:
        start = time.perf_counter()
        if self.stats["first_step_at"] is None:
            self.stats["first_step_at"] = time.time()
        if self.round_step == 0:
            self._begin_round()
        lay = self.layout
        batch = next(self.batches)
        rows = BatchRows(batch, self.fields)
        self._pull_missing(rows)
        local = {}
        for t, f in lay.table_ids.items():
            uniq = rows.unique[f]
            cache = self.caches[t]
            table = np.zeros((rows.padded_rows(f),) + cache.cur.shape[1:], np.float32)   # cur: all rows are pulled
            table[:len(uniq)] = cache.cur[cache.positions(uniq)]
            local[t] = table
        params = join_params(self.template, local, self.dense_cur)
        loss, grads = self.grad(params, rows.batch)
        updates, self.opt_state = self.optimizer.update(grads, self.opt_state, params)
        new = optax.apply_updates(params, updates)
        import jax
        for path, leaf in jax.tree_util.tree_flatten_with_path({k: v for k, v in new.items() if k not in local})[0]:
            self.dense_cur[jax.tree_util.keystr(path)] = np.asarray(leaf)
        for t, f in lay.table_ids.items():
            uniq = rows.unique[f]
            self.caches[t].cur[self.caches[t].positions(uniq)] = np.asarray(new[t])[:len(uniq)]
        samples = len(next(iter(batch.values())))
        self.round_samples += samples
        self.round_step += 1
        self.stats["steps"] += 1
        self.stats["samples"] += samples
        self.stats["losses"].append(float(loss))
        ack = self._push_deltas() if self.round_step == self.k_steps else self.last_ack
        spent = time.perf_counter() - start
        if self.delay_factor > 1:
            time.sleep((self.delay_factor - 1) * spent)
        self.stats["last_step_at"] = time.time()
        return ack

    def _pull_missing(self, rows: BatchRows) -> None:
        lay = self.layout
        requests = [dict() for _ in self.servers]
        wanted = {}
        for t, f in lay.table_ids.items():
            miss = self.caches[t].missing(rows.unique[f])
            wanted[t] = (miss, owners(miss, lay.table_bounds[t]))
            for s in range(lay.num_servers):
                requests[s][t] = miss[wanted[t][1] == s]
        if not any(len(i) for r in requests for i in r.values()):
            return
        pulled = self._call("pull", [(r, False) for r in requests])
        for t, (miss, own) in wanted.items():
            for s in range(lay.num_servers):
                got = pulled[s][2][t]
                self.caches[t].add(np.asarray(requests[s][t], np.int64), got)
                self.stats["bytes_pulled"] += got.nbytes

    def _push_deltas(self) -> dict:
        lay = self.layout
        scale = 1.0 / self.num_workers
        dense_delta = {k: (self.dense_cur[k] - self.dense_base[k]) * scale for k in self.dense_cur}
        pushes = []
        for s in range(lay.num_servers):
            sparse = {}
            for t in lay.table_ids:
                ids, cur, base = self.caches[t].touched()
                mine = owners(ids, lay.table_bounds[t]) == s
                sparse[t] = (ids[mine], ((cur[mine] - base[mine]) * scale).astype(np.float32))
            dg = {k: dense_delta[k] for k in lay.dense_on(s)}
            self.stats["bytes_pushed"] += sum(g.nbytes for g in dg.values()) + sum(
                i.nbytes + g.nbytes for i, g in sparse.values())
            pushes.append((self.index, self.versions[s], dg, sparse, self.round_samples))
        acks = self._call("push", pushes)
        self.stats["refused"] += sum(1 for a in acks if a["applied"] is False)
        self.round_step = 0
        self.last_ack = acks[0]
        return acks[0]
