"""Which server holds what: each table split by row ranges, each dense leaf whole
on one server (largest first onto the least loaded). Numpy only."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def row_bounds(rows: int, num_servers: int, table: str = "table") -> np.ndarray:
    """Boundaries [0, ..., rows] of ``num_servers`` contiguous row ranges. Rows need
    not divide the server count: the first ``rows % num_servers`` ranges hold one row
    more (nothing is padded)."""
    if num_servers < 1:
        raise ValueError(f"num_servers={num_servers}: need at least one server")
    if rows < num_servers:
        raise ValueError(f"table {table!r} has {rows} rows, fewer than the {num_servers} servers that would "
                         f"split it: use at most {rows} servers")
    base, extra = divmod(rows, num_servers)
    sizes = [base + (1 if s < extra else 0) for s in range(num_servers)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def owners(ids: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The server that holds each row id."""
    return np.searchsorted(bounds, ids, side="right") - 1


def assign_dense(nbytes: dict[str, int], num_servers: int) -> dict[str, int]:
    """Dense leaf name -> server, largest leaves first onto the least loaded server."""
    load = [0] * num_servers
    where = {}
    for name in sorted(nbytes, key=lambda n: (-nbytes[n], n)):
        s = int(np.argmin(load))
        where[name] = s
        load[s] += nbytes[name]
    return where


@dataclass(frozen=True)
class Layout:
    """Everything a worker needs to know about where parameters live."""
    num_servers: int
    table_bounds: dict          # table name -> row bounds (len num_servers + 1)
    table_ids: dict             # table name -> the batch field holding its ids
    dense_server: dict          # dense leaf name -> server

    @classmethod
    def build(cls, tables: dict, table_ids: dict, dense_nbytes: dict, num_servers: int) -> "Layout":
        """``tables``: name -> (rows, dim)."""
        bounds = {name: row_bounds(shape[0], num_servers, name) for name, shape in tables.items()}
        return cls(num_servers, bounds, dict(table_ids), assign_dense(dense_nbytes, num_servers))

    def dense_on(self, server: int) -> list[str]:
        return [n for n, s in self.dense_server.items() if s == server]


def split_params(params: dict, tables) -> tuple[dict, dict]:
    """(tables, dense leaves by name) of a parameter dict whose top-level keys
    ``tables`` are the embedding tables."""
    import jax
    if not isinstance(params, dict):
        raise TypeError(f"parameter-server training needs the parameters as a dict (the tables are top-level "
                        f"entries), got {type(params).__name__}")
    missing = [t for t in tables if t not in params]
    if missing:
        raise KeyError(f"tables {missing} are not top-level entries of the parameters (keys: {sorted(params)})")
    for t in tables:
        if np.ndim(params[t]) != 2:
            raise ValueError(f"table {t!r} must be [rows, dim], got shape {np.shape(params[t])}")
    dense = {k: v for k, v in params.items() if k not in tables}
    leaves = jax.tree_util.tree_flatten_with_path(dense)[0]
    named = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}
    return {t: np.asarray(params[t]) for t in tables}, named


def join_params(template: dict, tables: dict, dense: dict) -> dict:
    """The inverse of split_params: ``template`` is the dense part's structure."""
    import jax
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = jax.tree_util.tree_unflatten(treedef, [dense[jax.tree_util.keystr(p)] for p, _ in paths])
    out.update(tables)
    return out


def assemble(states: list, template: dict) -> dict:
    """The whole parameters from every server's ``state()`` (first rows, table rows, dense leaves)."""
    tables = {t: np.concatenate([st[1][t] for st in states]) for t in states[0][1]}
    dense = {}
    for _, _, d in states:
        dense.update(d)
    return join_params(template, tables, dense)
