"""The server actor: one row range of every table and a share of the dense
leaves. Async: each push is applied when it arrives (if it is not too stale).
Sync: pushes are summed and ``apply_accumulated`` applies their mean once every
worker of the step has pushed (the driver is the barrier). GEO: pushes are
deltas, added as they are."""
from __future__ import annotations

import os

import numpy as np

from . import sparse_update
from .staleness import StalenessBook

MODES = ("async", "sync", "geo")


def sum_rows(ids: np.ndarray, rows: np.ndarray, scale: float = 1.0) -> tuple:
    """(distinct ids, the rows of each id summed, times ``scale``): sorted, then reduced in
    runs (np.add.at, the obvious way, is several times slower)."""
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else np.zeros(0, np.int64)
    return ids[starts], np.add.reduceat(rows, starts, axis=0) * np.float32(scale) if len(ids) else rows


class ParameterServer:
    def __init__(self, index: int, tables: dict, dense: dict, optimizer, mode: str, max_staleness):
        """``tables``: name -> (first row, rows array of this server's range)."""
        self.index = index
        self.max_staleness = max_staleness
        self.reset(tables, dense, mode, optimizer)

    def reset(self, tables: dict, dense: dict, mode: str, optimizer=None) -> None:
        """Start over from these parameters (fresh optimizer state, version 0), with
        ``optimizer`` from now on if given."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: one of {MODES}")
        if optimizer is not None:
            self.optimizer = optimizer
            self.dense_step = sparse_update.dense_step(optimizer)
            self.row_update = sparse_update.RowUpdate(optimizer)
        self.mode = mode
        self.first_row = {name: int(lo) for name, (lo, _) in tables.items()}
        self.tables = {name: np.array(rows, np.float32) for name, (_, rows) in tables.items()}
        self.dense = {k: np.array(v) for k, v in dense.items()}
        if mode != "geo":
            self.table_state = {n: sparse_update.init_state(self.optimizer, t) for n, t in self.tables.items()}
            self.dense_state = sparse_update.init_dense(self.optimizer, self.dense) if self.dense else None
        self.book = StalenessBook(self.max_staleness)
        self.version = 0
        self.samples = 0
        self.pending = []           # sync: pushes of the current step

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> int:
        return self.version

    def pull(self, ids: dict, dense: bool = True) -> tuple:
        """(version, dense leaves held here (or {} when not asked), {table: rows at these global ids})."""
        rows = {n: self.tables[n][np.asarray(i) - self.first_row[n]] for n, i in ids.items()}
        return self.version, (self.dense if dense else {}), rows

    def push(self, worker: int, base_version: int, dense_grads: dict, sparse: dict, samples: int) -> dict:
        """``sparse``: table -> (distinct global ids, row gradients or deltas)."""
        self.samples += samples
        if self.mode == "sync":
            self.pending.append((dense_grads, sparse))
            return {"applied": None, "staleness": 0, "version": self.version, "samples": self.samples}
        ok, gap = self.book.admit(self.version, base_version)
        if ok:
            self._apply(dense_grads, sparse)
            self.version += 1
        return {"applied": ok, "staleness": gap, "version": self.version, "samples": self.samples}

    def apply_accumulated(self) -> int:
        """Sync: apply the mean of this step's pushes as one update."""
        if not self.pending:
            return self.version
        n = len(self.pending)
        dense = {k: sum(p[0][k] for p in self.pending) / n for k in self.dense} if self.dense else {}
        sparse = {}
        for name in self.tables:
            parts = [p[1][name] for p in self.pending if name in p[1] and len(p[1][name][0])]
            if not parts:
                continue
            sparse[name] = sum_rows(np.concatenate([i for i, _ in parts]), np.concatenate([g for _, g in parts]),
                                    scale=1.0 / n)
        self.pending = []
        self._apply(dense, sparse)
        self.book.admit(self.version, self.version)
        self.version += 1
        return self.version

    def _apply(self, dense_grads: dict, sparse: dict) -> None:
        if self.mode == "geo":     # deltas: add them
            for k, d in dense_grads.items():
                self.dense[k] += d
            for name, (ids, delta) in sparse.items():
                np.add.at(self.tables[name], np.asarray(ids) - self.first_row[name], delta)
            return
        if dense_grads:
            self.dense, self.dense_state = sparse_update.apply_dense(self.dense_step, self.dense, self.dense_state,
                                                                     dense_grads)
        for name, (ids, grads) in sparse.items():
            if len(ids):
                local = np.asarray(ids) - self.first_row[name]
                self.table_state[name] = self.row_update(self.tables[name], self.table_state[name], local, grads)

    def stats(self) -> dict:
        return {"server": self.index, "pid": os.getpid(), "version": self.version, "samples": self.samples,
                "staleness": self.book.summary()}

    def state(self) -> tuple:
        """(first rows, table rows, dense leaves): for assembling the trained parameters."""
        return self.first_row, self.tables, self.dense
