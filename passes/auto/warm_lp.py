"""One LP relaxation of the search problem, built once in HiGHS and solved again from
its last basis.

Under a memory limit the search solves the same LP many times with small changes:
each hand plan narrows its arguments' candidates (``hand.py``), the memory rounds
prune candidates by a plan to beat and add one memory row at a time (``search.py``),
and the searches ``compiler/memory_check.py`` runs again in one compile build the
same problem under a lower limit. Each of those is a change of column or row bounds,
or new rows, on one model: the dual simplex goes on from the optimal basis of the
solve before (a few dozen pivots) instead of building and solving ~100,000 variables
from nothing (about a second each on the 2-layer GPT step).

The model is ``milp.py``'s (one-hot ``x`` per decision, pair variables ``y`` per edge
tied by marginals, memory rows in bytes) as an LP over every candidate the reduction
keeps for any of the callers' narrowings; a narrowing is the upper bound 0 on the
``x`` outside it. The HiGHS bindings are highspy's where installed, else the same
bindings as scipy ships them; without either the callers solve from scratch
(``milp.solve``).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..cost import IMPOSSIBLE
from . import milp


def _bindings():
    """HiGHS's Python bindings (highspy's ``_core``; a dependency), or None."""
    try:
        from highspy import _core
    except ImportError:
        try:
            from scipy.optimize._highspy import _core   # (the same bindings, vendored by scipy >= 1.15)
        except ImportError:
            return None
    return _core if hasattr(_core, "_Highs") and hasattr(_core, "HighsLp") else None


def available() -> bool:
    return _bindings() is not None


class WarmLP:
    """The LP relaxation of ``red`` (a ``milp.Reduced``; candidates in the problem's
    numbering through ``red.kept``), kept in one HiGHS instance."""

    def __init__(self, red: "milp.Reduced"):
        core = _bindings()
        if core is None:
            raise RuntimeError("no HiGHS bindings (highspy or scipy >= 1.15)")
        self.core, self.red = core, red
        self.temps = sorted(red.unary)
        self.xoff, n = {}, 0
        for t in self.temps:
            self.xoff[t] = n
            n += len(red.unary[t])
        self.nx = n
        eoff = []
        for e in red.edges:
            eoff.append(n)
            n += e.cost.size
        c = np.zeros(n)
        for t in self.temps:
            c[self.xoff[t]:self.xoff[t] + len(red.unary[t])] = red.unary[t]
        for e, base in zip(red.edges, eoff):
            c[base:base + e.cost.size] = e.cost.ravel()
        # an impossible move is excluded (bound 0), not priced: scaled, its price would
        # put every real one under HiGHS's tolerances
        upper = np.ones(n)
        banned = c >= IMPOSSIBLE
        for t in self.temps:   # (a decision with no possible candidate keeps them all, priced)
            s = slice(self.xoff[t], self.xoff[t] + len(red.unary[t]))
            if banned[s].all():
                banned[s] = False
        upper[banned] = 0.0
        c = np.where(banned, 0.0, c)
        self.scale = float(np.abs(c).max()) or 1.0
        self.base_upper = upper
        rows, cols, vals = [np.arange(len(self.temps)).repeat([len(red.unary[t]) for t in self.temps])], \
            [np.arange(self.nx)], [np.ones(self.nx)]
        r = len(self.temps)
        for e, base in zip(red.edges, eoff):
            r = self._marginals(e.a, e.b, e.rows, e.cols, e.cost.shape, base, r, rows, cols, vals)
        self.n_marginal_rows = r
        A = _csc(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), r, n)
        lo = np.zeros(r)
        lo[:len(self.temps)] = 1.0
        hi = lo.copy()
        lp = core.HighsLp()
        lp.num_col_, lp.num_row_ = n, r
        lp.col_cost_ = c / self.scale
        lp.col_lower_ = np.zeros(n)
        lp.col_upper_ = upper
        lp.row_lower_, lp.row_upper_ = lo, hi
        lp.a_matrix_.format_ = core.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
        self.h = core._Highs()
        self.h.setOptionValue("output_flag", False)
        self.h.passModel(lp)
        self.ncol, self.nrow = n, r
        self.rows: dict = {}          # a memory row's key -> its row index in the model
        self.unit: Optional[float] = None   # bytes per unit of a memory row (HiGHS wants rows near 1)
        self.solves = 0
        # per solve: (wall s, process s, simplex iterations, memory rows, status), for
        # bench/search_time.py --lp-log (where a search's LP seconds go)
        self.log: list = []

    def _marginals(self, a, b, rows_a, cols_b, shape, base, r, rows, cols, vals) -> int:
        """The rows tying an edge's pair variables (at ``base``) to its two decisions'
        ``x``: for each class of ``a``, the pairs in its row sum to the ``x`` of its
        candidates; likewise for ``b``'s columns. Returns the next free row."""
        ka, kb = shape
        i, j = np.divmod(np.arange(ka * kb), kb)
        rows += [r + i, r + ka + j, r + rows_a, r + ka + cols_b]
        cols += [base + i * kb + j, base + i * kb + j,
                 self.xoff[a] + np.arange(len(rows_a)), self.xoff[b] + np.arange(len(cols_b))]
        vals += [np.ones(ka * kb), np.ones(ka * kb), -np.ones(len(rows_a)), -np.ones(len(cols_b))]
        return r + ka + kb

    def _add_row(self, key, row: "milp.MemoryRow", limit: float) -> int:
        """Add one memory row (and the pair variables of the copies it counts); its index."""
        if self.unit is None:
            self.unit = float(limit)
        kept = self.red.kept
        rows, cols, vals = [], [], []
        r = self.nrow
        new_cols = 0
        for a, b, rows_a, cols_b, nbytes in row.pairs:   # a copy between two decisions: pairs of its own
            ra, rmap = milp._compact(rows_a[kept[a]])
            cb, cmap = milp._compact(cols_b[kept[b]])
            block = nbytes[np.ix_(rmap, cmap)]
            base = self.ncol + new_cols
            r = self._marginals(a, b, ra, cb, block.shape, base, r, rows, cols, vals)
            new_cols += block.size
            row.__dict__.setdefault("_warm_blocks", []).append((base, block))
        if new_cols:
            z = np.zeros(new_cols)
            self.h.addCols(new_cols, z, z, np.ones(new_cols), 0, np.zeros(0, np.int32), np.zeros(0, np.int32),
                           np.zeros(0))
        mr = r
        for t, vec in row.nodes.items():
            v = vec[kept[t]]
            rows.append(np.full(len(v), mr))
            cols.append(self.xoff[t] + np.arange(len(v)))
            vals.append(v / self.unit)
        for base, block in row.__dict__.pop("_warm_blocks", []):
            rows.append(np.full(block.size, mr))
            cols.append(base + np.arange(block.size))
            vals.append(block.ravel() / self.unit)
        r = mr + 1
        self.ncol += new_cols
        A = _csc(np.concatenate(rows) - self.nrow, np.concatenate(cols), np.concatenate(vals), r - self.nrow,
                 self.ncol).tocsr()
        lo = np.zeros(r - self.nrow)
        hi = np.zeros(r - self.nrow)
        lo[-1], hi[-1] = -np.inf, np.inf   # (the memory row itself; its bound is set per solve)
        self.h.addRows(r - self.nrow, lo, hi, A.nnz, A.indptr[:-1].astype(np.int32), A.indices.astype(np.int32),
                       A.data)
        self.nrow = r
        self.rows[key] = mr
        return mr

    def cold_seconds(self) -> Optional[float]:
        """Wall seconds of this model's first solve, from nothing (None before it): what a
        cold LP of the problem costs."""
        return self.log[0][0] if self.log else None

    def basis(self):
        """The model's current basis, for ``restore``."""
        return self.h.getBasis()

    def restore(self, basis) -> None:
        """Go on from ``basis`` (of this model, taken before any row was added since)."""
        self.h.setBasis(basis)

    def solve(self, allowed: Optional[dict] = None, rows=(), limit: Optional[float] = None,
              time_limit: Optional[float] = None, cutoff: Optional[float] = None) -> "milp.Solution":
        """The LP optimum with each decision's candidates narrowed to ``allowed``
        (template -> indices in the problem's numbering; the rest as reduced) and the
        memory ``rows`` held to ``limit``; the other rows of earlier solves are lifted.
        A ``milp.Solution`` as ``milp.solve(..., relax=True)`` gives it: ``choice`` each
        decision's heaviest candidate, ``bound`` the LP's optimum less the tie-break,
        ``rounded`` whether it was fractional, ``support`` and ``complete``. No choice
        where the LP is infeasible or out of time. ``cutoff`` (seconds): the dual simplex
        stops once its bound passes it (its objective only rises), with no choice and
        ``above`` set to it."""
        t0 = time.perf_counter()
        red = self.red
        upper = self.base_upper[:self.nx].copy()
        for t, ok in (allowed or {}).items():
            mask = np.isin(red.kept[t], ok)
            s = slice(self.xoff[t], self.xoff[t] + len(mask))
            upper[s] = np.where(mask, upper[s], 0.0)
        idx = np.arange(self.nx, dtype=np.int32)
        self.h.changeColsBounds(self.nx, idx, np.zeros(self.nx), upper)
        active = set()
        for row in rows:
            key = row.point if getattr(row, "point", None) is not None else ("object", id(row))
            if key not in self.rows:
                self._add_row(key, row, limit)
            active.add(self.rows[key])
        for key, at in self.rows.items():
            self.h.changeRowBounds(at, -np.inf, float(limit) / self.unit if at in active else np.inf)
        # (HiGHS holds time_limit against the instance's run clock, which goes on across runs)
        self.h.setOptionValue("time_limit", self.h.getRunTime() + float(time_limit) if time_limit is not None
                              else np.inf)
        self.h.setOptionValue("objective_bound", (cutoff + red.tie) / self.scale if cutoff is not None else np.inf)
        c0 = time.process_time()
        self.h.run()
        self.solves += 1
        status = self.h.getModelStatus()
        seconds = time.perf_counter() - t0
        self.log.append((seconds, time.process_time() - c0, int(self.h.getInfo().simplex_iteration_count),
                         len(active), self.h.modelStatusToString(status)))
        if status == self.core.HighsModelStatus.kObjectiveBound:
            out = milp.Solution({}, float("inf"), cutoff, float("inf"),
                                f"LP: its bound passed {cutoff * 1e3:.4f} ms", seconds, self.ncol, self.nx)
            out.above = cutoff
            return out
        if status != self.core.HighsModelStatus.kOptimal:
            out = milp.Solution({}, float("inf"), float("inf"), float("inf"),
                                f"LP: {self.h.modelStatusToString(status)}", seconds, self.ncol, self.nx)
            out.timed_out = status == self.core.HighsModelStatus.kTimeLimit
            return out
        x = np.asarray(self.h.getSolution().col_value)[:self.nx]
        fractions = {t: x[self.xoff[t]:self.xoff[t] + len(red.unary[t])] for t in self.temps}
        choice = {t: int(red.kept[t][int(np.argmax(w))]) for t, w in fractions.items()}
        obj = float(self.h.getObjectiveValue()) * self.scale
        out = milp.Solution(choice, obj, obj - red.tie, 0.0, "LP relaxation (warm-started)", seconds, self.ncol,
                            self.nx)
        out.rounded = bool(np.abs(x - np.round(x)).max(initial=0.0) >= 1e-7)
        out.support = {t: (red.kept[t][w > 1e-7], w[w > 1e-7]) for t, w in fractions.items()}
        out.complete = dict   # (every decision is in the LP: a rounding is a whole plan)
        return out


def _csc(rows, cols, vals, nrow, ncol):
    from scipy.sparse import coo_matrix
    A = coo_matrix((vals, (rows, cols)), shape=(nrow, ncol)).tocsc()
    A.sum_duplicates()
    A.indptr, A.indices = A.indptr.astype(np.int32), A.indices.astype(np.int32)
    return A
