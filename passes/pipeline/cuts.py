"""Where to cut a program into pipeline stages: dynamic programming over contiguous ranges.

The input is a program already flattened into ``L`` *layers* (layers, or ops in program
order, or the segments between ``stage_boundary`` marks), each with

- ``layer_time[i]``: its modeled forward + backward time for one micro-batch (the cost
  model's roofline / collective times of the layer's ops under their chosen strategies);
- ``boundary_time[i]`` (``L-1`` entries): the time to exchange, for one micro-batch, the
  values crossing a cut between layer ``i`` and ``i+1`` (alpha-beta of their bytes over
  the ``pp`` link); ``math.inf`` forbids a cut there;
- ``param_bytes[i]`` and ``activation_bytes[i]``: parameter (plus gradient and optimizer
  state, as the caller counts them) bytes, and the bytes one micro-batch's activations
  keep alive until its backward.

A **stage** is a contiguous range ``[a, b)`` of layers; ``p * v`` stages in model order
(model stage ``k`` runs on pipeline stage ``k % p``, chunk ``k // p``). Per stage:

- ``compute = sum(layer_time[a:b])``;
- ``exchange = boundary_time[a-1] + boundary_time[b-1]`` (the gradient sent back to the
  previous stage and the activation sent on to the next; a stage pays its own sends,
  as the lockstep SPMD lowering does, where a tick's ppermute follows its compute);
- ``time = compute + exchange``;
- ``memory = sum(param_bytes[a:b]) + in_flight * sum(activation_bytes[a:b])`` where
  ``in_flight`` is what the schedule keeps at that stage (``Schedule.peak_in_flight``:
  GPipe ``m``, 1F1B and ZB-H1 ``min(p-s, m)``). With ``v > 1`` a stage holds ``v``
  chunks; each chunk must fit ``memory_limit / v`` with its stage's whole in-flight
  count (a sufficient, conservative rule that keeps the DP separable).

Objectives (``objective=``):

- ``"formula"``: ``T = sum(time) / v + (m*v - 1) * max(time)`` -- Alpa's
  ``sum t_i + (B-1) max t_i`` with the exchanges Alpa leaves out, generalised to ``v``
  chunks so that balanced stages give the interleaved bubble exactly
  (``(m*v + p - 1) * t``). For ``v > 1`` it prices the slowest *chunk*, while a stage
  runs the sum of its chunks, so it can misjudge cuts that balance stages but not
  chunks; the simulated objective corrects that. The DP is exact for it: it enumerates the bottleneck
  ``t_max`` over every stage time that can occur (from the least feasible bottleneck up,
  stopping once ``(m*v-1) * t_max`` alone cannot win) and, for each, minimises
  ``sum(time)`` with every stage ``<= t_max``.
- ``"simulate"`` (default): the makespan of the chosen schedule in the event simulator
  (:mod:`.simulate`) with per-stage durations F = ``forward_fraction * compute`` + the
  forward send and B = the rest + the backward send (ZB-H1 splits B's compute evenly
  into I and W; I carries the send). The DP's best distinct cuts by formula are
  simulated, then improved by moving single cuts while the makespan falls.

``brute_force_cuts`` evaluates every cut with plain loops (no shared cost code) for tests
(up to 12 layers). The search (later) calls ``plan_cuts`` per (p, m, schedule, v)
candidate with times from the cost model and keeps the least ``step_time``; the lowering
takes ``StageCuts.bounds`` (which layers each stage runs) and ``StageCuts.schedule``.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

from ...ir.errors import ShardingError
from .schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Schedule, build_schedule
from .simulate import simulate

OBJECTIVES = ("simulate", "formula")


@dataclass(frozen=True)
class StageCuts:
    """The chosen stages. ``bounds[k] = (a, b)``: model stage ``k`` runs layers ``a..b-1``."""
    bounds: tuple
    compute_times: tuple
    exchange_times: tuple
    stage_times: tuple
    memory: tuple               # per model stage, bytes (zeros when no memory was given)
    in_flight: tuple            # per model stage, micro-batch activations kept
    formula_time: float
    simulated_time: float
    step_time: float            # the objective's value: simulated_time or formula_time
    schedule: Schedule

    @property
    def cuts(self) -> tuple:
        """The first layer of every stage but the first."""
        return tuple(a for a, _ in self.bounds[1:])

    def layers(self, k: int) -> range:
        a, b = self.bounds[k]
        return range(a, b)

    def stage_of(self) -> tuple:
        """The model stage of every layer."""
        return tuple(k for k, (a, b) in enumerate(self.bounds) for _ in range(a, b))


def even_bounds(L: int, S: int) -> tuple:
    """Equal-layer stages: ``L // S`` layers each, the first ``L % S`` stages one more, so
    every layer is in exactly one stage (30 layers on 4 stages: 8, 8, 7, 7)."""
    if not 1 <= S <= L:
        raise ShardingError(f"cannot cut {L} layers into {S} stages: every stage needs a layer; use at most "
                            f"{L} stages")
    q, r = divmod(L, S)
    out, a = [], 0
    for k in range(S):
        b = a + q + (k < r)
        out.append((a, b))
        a = b
    return tuple(out)


# ---- inputs ----

def _seq(x, n: int, what: str, default=0.0, allow_inf: bool = False) -> list:
    if x is None:
        return [default] * n
    x = list(x)
    if len(x) != n:
        raise ShardingError(f"pipeline cuts: {what} has {len(x)} entries, expected {n}")
    for v in x:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= 0 or \
                (math.isinf(v) and not allow_inf):
            raise ShardingError(f"pipeline cuts: {what} must be {'' if allow_inf else 'finite '}numbers >= 0, "
                                f"got {v!r}")
    return [float(v) for v in x]


@dataclass
class _Problem:
    L: int
    p: int
    m: int
    v: int
    schedule: Schedule
    time: list
    boundary: list
    params: list
    acts: list
    limit: Optional[float]
    fwd_frac: float

    def __post_init__(self):
        self._in_flight = self.schedule.peak_in_flight()

    @property
    def S(self) -> int:
        return self.p * self.v

    def in_flight(self, k: int) -> int:
        return self._in_flight[k % self.p]

    def stage_limit(self) -> float:
        return math.inf if self.limit is None else self.limit / self.v


def _problem(layer_time, p, m, schedule, v, boundary_time, param_bytes, activation_bytes, memory_limit,
             forward_fraction) -> _Problem:
    L = len(layer_time)
    time = _seq(layer_time, L, "layer_time")
    sched = build_schedule(schedule, p, m, v)
    if not 1 <= p * v <= L:
        raise ShardingError(f"cannot cut {L} layers into p*v = {p}*{v} = {p * v} stages: every stage needs a "
                            f"layer; use at most {L} stages (or split the layers finer)")
    boundary = _seq(boundary_time, max(L - 1, 0), "boundary_time", allow_inf=True)
    if p == 1:   # every model stage on the one pipeline stage: nothing crosses a link
        boundary = [math.inf if math.isinf(x) else 0.0 for x in boundary]
    if not 0 < float(forward_fraction) < 1:
        raise ShardingError(f"pipeline cuts: forward_fraction must be in (0, 1), got {forward_fraction}")
    if memory_limit is not None and not memory_limit > 0:
        raise ShardingError(f"pipeline cuts: memory_limit must be > 0 bytes, got {memory_limit!r}")
    return _Problem(L, p, m, v, sched, time, boundary, _seq(param_bytes, L, "param_bytes"),
                    _seq(activation_bytes, L, "activation_bytes"), memory_limit, float(forward_fraction))


# ---- evaluating one cut (plain loops: the brute force's and the result's code path) ----

def _evaluate(pr: _Problem, bounds, objective: str, simulate_too: bool = True) -> Optional[StageCuts]:
    """The stage times, memory and objective of ``bounds``; None when a stage breaks the
    memory limit or a cut sits where ``boundary_time`` is inf."""
    compute, exchange, mem, fl = [], [], [], []
    for k, (a, b) in enumerate(bounds):
        c = 0.0
        for i in range(a, b):
            c += pr.time[i]
        e = (pr.boundary[a - 1] if a > 0 else 0.0) + (pr.boundary[b - 1] if b < pr.L else 0.0)
        if math.isinf(e):
            return None
        par = act = 0.0
        for i in range(a, b):
            par += pr.params[i]
            act += pr.acts[i]
        n = pr.in_flight(k)
        used = par + n * act
        if used > pr.stage_limit() * (1 + 1e-9):
            return None
        compute.append(c)
        exchange.append(e)
        mem.append(used)
        fl.append(n)
    times = [c + e for c, e in zip(compute, exchange)]
    formula = sum(times) / pr.v + (pr.m * pr.v - 1) * max(times)
    sim = _simulated(pr, bounds, compute) if simulate_too else math.nan
    return StageCuts(tuple(bounds), tuple(compute), tuple(exchange), tuple(times), tuple(mem), tuple(fl),
                     formula, sim, sim if objective == "simulate" else formula, pr.schedule)


def _simulated(pr: _Problem, bounds, compute) -> float:
    fwd, bwd, bin_, wgt = [], [], [], []
    for k, (a, b) in enumerate(bounds):
        send_on = pr.boundary[b - 1] if b < pr.L else 0.0
        send_back = pr.boundary[a - 1] if a > 0 else 0.0
        back = (1.0 - pr.fwd_frac) * compute[k]
        fwd.append(pr.fwd_frac * compute[k] + send_on)
        bwd.append(back + send_back)
        bin_.append(back / 2 + send_back)
        wgt.append(back / 2)
    durations = {FORWARD: fwd, BACKWARD: bwd, BACKWARD_INPUT: bin_, BACKWARD_WEIGHT: wgt}
    return float(simulate(pr.schedule, durations).makespan)


# ---- the dynamic program ----

def _matrices(pr: _Problem):
    """Per model stage k, (time[a, b], memory[a, b]) of running layers a..b-1 as stage k;
    inf where that is not allowed (empty, not starting at 0 / ending at L for the first /
    last stage, over the memory limit, or cut at an inf boundary)."""
    L, S = pr.L, pr.S
    pt = np.concatenate([[0.0], np.cumsum(pr.time)])
    pp_ = np.concatenate([[0.0], np.cumsum(pr.params)])
    pa = np.concatenate([[0.0], np.cumsum(pr.acts)])
    a = np.arange(L + 1)[:, None]
    b = np.arange(L + 1)[None, :]
    valid = a < b
    bnd = np.concatenate([[0.0], pr.boundary, [0.0]])         # bnd[j]: exchange of a cut before layer j
    with np.errstate(invalid="ignore"):
        compute = pt[None, :] - pt[:, None]
        exchange = bnd[:, None] + bnd[None, :]
        times = np.where(valid, compute + exchange, np.inf)
    times[~np.isfinite(times)] = np.inf
    out = []
    for k in range(S):
        mem = (pp_[None, :] - pp_[:, None]) + pr.in_flight(k) * (pa[None, :] - pa[:, None])
        ok = valid & np.isfinite(times) & (mem <= pr.stage_limit() * (1 + 1e-9))
        if k == 0:
            ok &= a == 0
        if k == S - 1:
            ok &= b == L
        out.append((np.where(ok, times, np.inf), np.where(ok, mem, np.inf)))
    return out


def _bottleneck(mats) -> float:
    """min over cuts of max over stages (of the given matrices)."""
    f = np.full(mats[0].shape[0], np.inf)
    f[0] = 0.0
    for c in mats:
        f = np.min(np.maximum(f[:, None], c), axis=0)
    return float(f[-1])


def _min_sum(mats, t_max: float):
    """min over cuts of sum of stage times with every stage <= t_max, and its bounds."""
    f = np.full(mats[0].shape[0], np.inf)
    f[0] = 0.0
    back = []
    for c in mats:
        masked = np.where(c <= t_max, c, np.inf)
        tot = f[:, None] + masked
        arg = np.argmin(tot, axis=0)
        f = tot[arg, np.arange(tot.shape[1])]
        back.append(arg)
    if not np.isfinite(f[-1]):
        return math.inf, None
    bounds, b = [], len(f) - 1
    for arg in reversed(back):
        a = int(arg[b])
        bounds.append((a, b))
        b = a
    return float(f[-1]), tuple(reversed(bounds))


def _no_fit_error(pr: _Problem) -> ShardingError:
    least = _bottleneck([mem_free for _, mem_free in _matrices(_relaxed(pr))])
    where = f"p={pr.p}, m={pr.m}, schedule={pr.schedule.name!r}" + (f", v={pr.v}" if pr.v > 1 else "")
    if math.isinf(least):
        return ShardingError(f"pipeline cuts: no way to cut {pr.L} layers into {pr.S} stages ({where}): every "
                             f"allowed cut point has boundary_time inf; allow more cut points")
    limit = f"memory_limit={pr.limit:.6g} bytes" + (f" ({pr.limit / pr.v:.6g} per chunk)" if pr.v > 1 else "")
    return ShardingError(
        f"pipeline cuts: no cut of {pr.L} layers into {pr.S} stages fits {limit} ({where}): the least any cut "
        f"needs is {least * pr.v if pr.v > 1 else least:.6g} bytes on its fullest stage, parameters plus the "
        f"activations of the micro-batches the schedule keeps in flight; raise memory_limit, use more stages, a "
        f"schedule that keeps fewer activations (1f1b instead of gpipe), or recompute activations")


def _relaxed(pr: _Problem) -> _Problem:
    return _Problem(pr.L, pr.p, pr.m, pr.v, pr.schedule, pr.time, pr.boundary, pr.params, pr.acts, None,
                    pr.fwd_frac)


def plan_cuts(layer_time: Sequence[float], p: int, m: int, schedule: str = "1f1b", v: int = 1, *,
              boundary_time: Optional[Sequence[float]] = None, param_bytes: Optional[Sequence[float]] = None,
              activation_bytes: Optional[Sequence[float]] = None, memory_limit: Optional[float] = None,
              forward_fraction=Fraction(1, 3), objective: str = "simulate", candidates: int = 16, starts: int = 3,
              budget: int = 300) -> StageCuts:
    """Contiguous stage cuts of ``layer_time`` into ``p * v`` stages minimising the modeled
    step time (see the module docstring). Raises ``ShardingError`` when no cut fits the
    memory limit (naming the least memory any cut needs) or the numbers are invalid."""
    if objective not in OBJECTIVES:
        raise ShardingError(f"pipeline cuts: objective must be one of {OBJECTIVES}, got {objective!r}")
    pr = _problem(layer_time, p, m, schedule, v, boundary_time, param_bytes, activation_bytes, memory_limit,
                  forward_fraction)
    mats = _matrices(pr)
    times = [t for t, _ in mats]
    lo = _bottleneck(times)
    if math.isinf(lo):
        raise _no_fit_error(pr)
    beta, total = pr.m * pr.v - 1, sum(pr.time)
    values = np.unique(np.concatenate([t[np.isfinite(t)] for t in times]))
    values = values[values >= lo * (1 - 1e-12)]
    found = {}                                           # bounds -> formula value (from the DP)
    best = math.inf
    for t_max in values:
        if total / pr.v + beta * t_max > best * (1 + 1e-12):
            break
        s, bounds = _min_sum(times, float(t_max))
        if bounds is None:
            continue
        value = s / pr.v + beta * float(t_max)
        found[bounds] = min(value, found.get(bounds, math.inf))
        best = min(best, value)
    ranked = sorted(found, key=lambda b: (found[b], b))
    if objective == "formula":
        return _evaluate(pr, ranked[0], objective)
    pool = [r for r in (_evaluate(pr, b, objective) for b in ranked[:max(1, candidates)]) if r is not None]
    pool.sort(key=lambda r: (r.simulated_time, r.formula_time))
    seen = {}
    results = [_improve(pr, start, objective, seen, budget) for start in pool[:max(1, starts)]]
    return min(results, key=lambda r: (r.simulated_time, r.formula_time))


def _improve(pr: _Problem, cur: StageCuts, objective: str, seen: dict, budget: int) -> StageCuts:
    """Local search on the simulated step time (the simulator is not decomposable over
    stages, so the DP's formula only seeds it): move one cut to any position between its
    neighbours, a run of cuts by one layer, or two cuts by one or two layers each, while the makespan falls (at most
    ``budget`` simulations in all, ``seen`` shared between starts)."""
    seen[cur.bounds] = cur

    def moves(bounds):
        edges = [a for a, _ in bounds] + [pr.L]
        for k in range(1, pr.S):                      # one cut anywhere between its neighbours
            for cut in range(edges[k - 1] + 1, edges[k + 1]):
                yield {k: cut}
        for k, j in itertools.combinations(range(1, pr.S), 2):
            for step in (-1, 1):                      # a run of cuts shifted together
                yield {i: edges[i] + step for i in range(k, j + 1)}
        for k, j in itertools.combinations(range(1, pr.S), 2):
            for dk, dj in itertools.product((-2, -1, 1, 2), repeat=2):
                yield {k: edges[k] + dk, j: edges[j] + dj}

    improved = True
    while improved and len(seen) < budget:
        improved = False
        for move in moves(cur.bounds):
            edges = [a for a, _ in cur.bounds] + [pr.L]
            for k, cut in move.items():
                edges[k] = cut
            if any(x >= y for x, y in zip(edges, edges[1:])):
                continue
            bounds = tuple(zip(edges[:-1], edges[1:]))
            if bounds not in seen:
                if len(seen) >= budget:
                    break
                seen[bounds] = _evaluate(pr, bounds, objective)
            r = seen[bounds]
            if r is not None and r.simulated_time < cur.simulated_time * (1 - 1e-12):
                cur, improved = r, True
                break
    return cur


def brute_force_cuts(layer_time: Sequence[float], p: int, m: int, schedule: str = "1f1b", v: int = 1, *,
                     boundary_time=None, param_bytes=None, activation_bytes=None, memory_limit=None,
                     forward_fraction=Fraction(1, 3), objective: str = "simulate") -> StageCuts:
    """Every cut evaluated (reference for tests; at most 12 layers)."""
    pr = _problem(layer_time, p, m, schedule, v, boundary_time, param_bytes, activation_bytes, memory_limit,
                  forward_fraction)
    if pr.L > 12:
        raise ShardingError(f"brute_force_cuts is a test reference for at most 12 layers, got {pr.L}")
    best = None
    for starts in itertools.combinations(range(1, pr.L), pr.S - 1):
        edges = (0,) + starts + (pr.L,)
        r = _evaluate(pr, tuple(zip(edges[:-1], edges[1:])), objective, simulate_too=objective == "simulate")
        if r is not None and (best is None or r.step_time < best.step_time):
            best = r
    if best is None:
        raise _no_fit_error(pr)
    return best if objective == "simulate" else _evaluate(pr, best.bounds, objective)


def evaluate_cuts(bounds, layer_time, p: int, m: int, schedule: str = "1f1b", v: int = 1, *,
                  boundary_time=None, param_bytes=None, activation_bytes=None, memory_limit=None,
                  forward_fraction=Fraction(1, 3), objective: str = "simulate") -> StageCuts:
    """The times and memory of given stage ``bounds`` (e.g. from ``stage_boundary`` marks
    or ``even_bounds``); ``ShardingError`` when they break the memory limit."""
    pr = _problem(layer_time, p, m, schedule, v, boundary_time, param_bytes, activation_bytes, memory_limit,
                  forward_fraction)
    bounds = tuple((int(a), int(b)) for a, b in bounds)
    edges = [a for a, _ in bounds] + [bounds[-1][1]] if bounds else []
    if len(bounds) != pr.S or edges[0] != 0 or edges[-1] != pr.L or \
            any(b0 != a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:])) or any(a >= b for a, b in bounds):
        raise ShardingError(f"pipeline cuts: {bounds} is not {pr.S} non-empty contiguous ranges covering "
                            f"layers 0..{pr.L - 1}")
    r = _evaluate(pr, bounds, objective)
    if r is None:
        raise ShardingError(f"pipeline cuts: stages {bounds} break memory_limit={pr.limit} or cut where "
                            f"boundary_time is inf")
    return r


# The layers a search cuts a long program into: at most CUT_WINDOWS windows of the
# forward's time, and at least STAGE_WINDOWS per stage (pp=64: 256 windows), so the
# DP stays over about a hundred layers whatever the op count.
CUT_WINDOWS = 96
STAGE_WINDOWS = 4


def cut_windows(exchange: Sequence[float], seconds: Sequence[float], windows: int = CUT_WINDOWS) -> list:
    """The cheap cut points: the forward's time (``seconds`` per op) split into
    ``windows`` equal windows, in each the allowed point (finite ``exchange``: the bytes
    crossing a cut after op ``n``) where the fewest bytes cross (a transformer's residual
    stream between blocks). Used by ``sp.plan_step`` (``compiler/planning.py``) and the
    pipelined step's search (``compiler/pipeline_step.py``)."""
    T = np.cumsum(seconds)[:len(exchange)]
    total = float(np.sum(seconds)) or 1.0
    best: dict = {}
    for n, (t, x) in enumerate(zip(T.tolist(), exchange)):
        if not math.isfinite(x):
            continue
        w = min(int(t / total * windows), windows - 1)
        if w not in best or x < exchange[best[w]]:
            best[w] = n
    return sorted(best.values())
