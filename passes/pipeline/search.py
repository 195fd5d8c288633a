"""Searching pipeline configurations: pp x dp x tp x micro-batches x schedule (x virtual
stages) x cuts, all under a memory limit (issue 26). Pure planning: numbers in, a ranked
list out; no JAX.

What it is given (:class:`LayerCosts`, per tensor-parallel degree ``tp``: ``costs(tp)``):
the model flattened into ``L`` layers (layers, or op ranges between cheap cut points), and
per layer, for one micro-batch of ``rows`` rows on one data-parallel replica, on a stage
of ``tp`` devices:

- ``forward_s`` / ``backward_s``: modeled seconds (compute and tp's collectives), of which
  ``forward_fixed_s`` / ``backward_fixed_s`` do not scale with the rows (latencies);
- ``state_bytes``: parameters, gradients and optimizer state per device; ``grad_bytes``:
  the gradients data parallelism all-reduces; ``update_s``: the optimizer's seconds, once
  per step;
- ``activation_bytes``: what one micro-batch keeps alive until its backward;
- ``exchange_bytes`` (``L-1``): what crosses a cut after layer ``i``, per micro-batch.

A micro-batch of ``r`` rows scales the row-proportional parts by ``r / rows``.

How a candidate ``(pp, dp, tp, m, schedule, v)`` is priced, on the mesh
``(pp, dp, tp)`` named ``axis_names`` and the given cost model (a ``ClusterCost`` prices a
group by where its members sit):

- pp's exchanges: ``cost.collective_time(bytes, "permute", (pp,), mesh)`` per cut and
  micro-batch, in both directions (``cuts.py`` adds them to the sending stage);
- the pipeline: the cuts (``cuts.plan_cuts``) and the schedule's makespan in the event
  simulator, so the bubble and the exchanges are in the objective;
- after the pipeline drains, each stage all-reduces its gradients over dp
  (``cost.collective_time(wire_bytes("all_reduce", grads, dp), "all_reduce", (dp,), mesh)``)
  and runs its optimizer update; the slowest stage's sum is added (not overlapped);
- memory per device: the stage's state plus the activations of the micro-batches its
  schedule keeps in flight (GPipe ``m``, 1F1B / ZB-H1 ``min(p - s, m)``,
  ``Schedule.peak_in_flight``); a candidate over ``memory_limit`` is rejected.

How it is searched (fast enough for a 48-layer GPT over 1,024 devices in well under
20 s):

1. every mesh ``pp * dp * tp == devices`` (``pp <= L``), every micro-batch count ``m``
   dividing the per-replica batch (up to ``max_microbatches``), and interleaving with
   ``v`` in ``virtual_stages`` where ``m % pp == 0`` and ``pp * v <= L``; what cannot run
   is listed with its reason (divisibility, too few layers, ``costs(tp)`` raising);
2. each is given a lower bound (no bubble, no exchange: ``m * sum(t) / pp`` plus the
   mean stage's gradient sync and update) and screened in that order with the exact
   DP on ``cuts.py``'s closed form (``objective="formula"``, 1F1B's memory, the least
   any schedule keeps); once a lower bound exceeds the best screened time the rest
   cannot win and are counted as pruned;
3. the ``finalists`` best screened configurations are planned for each schedule with the
   simulator as the objective (``plan_cuts(objective="simulate")``): gpipe, 1f1b and
   zero_bubble for ``v = 1``, interleaved for ``v > 1``, each under the memory limit
   with its own activations in flight.

``search_pipeline`` returns a :class:`SearchResult`: the best candidate, every ranked
candidate (simulated finalists first, then the screened ones by their closed form) and
every rejected one with its reason.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from ...ir.errors import ShardingError
from ...ir.mesh import Mesh
from .cuts import StageCuts, evaluate_cuts, plan_cuts

FLAT_SCHEDULES = ("gpipe", "1f1b", "zero_bubble")


class NoPipelineFits(ShardingError):
    """No pipeline configuration fits ``memory_limit`` by the pipeline's own count (each
    stage's state and the activations its schedule keeps in flight): a plan of the stages'
    work that holds fewer bytes per device may still fit."""


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of one stage configuration (see the module docstring)."""
    forward_s: tuple
    backward_s: tuple
    state_bytes: tuple
    activation_bytes: tuple
    exchange_bytes: tuple
    grad_bytes: tuple = ()
    update_s: tuple = ()
    forward_fixed_s: tuple = ()
    backward_fixed_s: tuple = ()
    rows: int = 1
    names: tuple = ()

    def __post_init__(self):
        L = len(self.forward_s)
        if L < 1:
            raise ShardingError("pipeline search: LayerCosts needs at least one layer")
        for name in ("forward_s", "backward_s", "state_bytes", "activation_bytes", "grad_bytes", "update_s",
                     "forward_fixed_s", "backward_fixed_s"):
            x = tuple(float(v) for v in getattr(self, name)) or (0.0,) * L
            if len(x) != L or any(not (v >= 0 and math.isfinite(v)) for v in x):
                raise ShardingError(f"pipeline search: LayerCosts.{name} must be {L} finite numbers >= 0")
            object.__setattr__(self, name, x)
        ex = tuple(float(v) for v in self.exchange_bytes)
        if len(ex) != L - 1 or any(not v >= 0 for v in ex):
            raise ShardingError(f"pipeline search: LayerCosts.exchange_bytes must be {L - 1} numbers >= 0 "
                                "(inf forbids a cut)")
        object.__setattr__(self, "exchange_bytes", ex)
        if not (isinstance(self.rows, int) and self.rows >= 1):
            raise ShardingError(f"pipeline search: LayerCosts.rows must be a positive integer, got {self.rows!r}")

    @property
    def layers(self) -> int:
        return len(self.forward_s)

    def at_rows(self, rows: int) -> tuple:
        """(forward, backward, activation, exchange) per layer for micro-batches of ``rows``."""
        s = rows / self.rows
        fwd = tuple(c + (t - c) * s for t, c in zip(self.forward_s, self.forward_fixed_s))
        bwd = tuple(c + (t - c) * s for t, c in zip(self.backward_s, self.backward_fixed_s))
        return fwd, bwd, tuple(a * s for a in self.activation_bytes), tuple(e * s for e in self.exchange_bytes)


@dataclass(frozen=True)
class Candidate:
    """One configuration and what it costs, or why it cannot run (``reason``)."""
    pp: int
    dp: int
    tp: int
    microbatches: int = 0
    schedule: str = ""
    virtual_stages: int = 1
    step_s: float = math.inf
    pipeline_s: float = math.inf     # the pipeline's makespan (simulated) or closed form (screened)
    sync_s: float = 0.0              # the slowest stage's gradient all-reduce over dp plus optimizer update
    memory_bytes: float = 0.0        # the fullest device: state plus activations in flight
    cuts: Optional[StageCuts] = field(default=None, compare=False)
    simulated: bool = False
    reason: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def mesh(self) -> tuple:
        return (self.pp, self.dp, self.tp)

    def describe(self) -> str:
        sched = self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        head = f"pp={self.pp} dp={self.dp} tp={self.tp}" + (f" m={self.microbatches} {sched}" if sched else "")
        if not self.ok:
            return f"{head}: rejected, {self.reason}"
        how = "simulated" if self.simulated else "closed form"
        return (f"{head}: {self.step_s * 1e3:.3f} ms ({how}; pipeline {self.pipeline_s * 1e3:.3f} ms, sync and "
                f"update {self.sync_s * 1e3:.3f} ms), {self.memory_bytes / 2**30:.2f} GiB per device")


@dataclass
class SearchResult:
    best: Candidate
    ranked: list          # feasible candidates: simulated finalists fastest first, then the screened ones
    rejected: list        # Candidates with a reason
    pruned: int           # configurations whose lower bound could not beat the best
    screened: int         # configurations the closed-form DP priced
    seconds: float

    def table(self, n: int = 10) -> str:
        lines = [f"pipeline search: {len(self.ranked)} feasible, {len(self.rejected)} rejected, {self.pruned} "
                 f"pruned by their lower bound, {self.screened} screened, in {self.seconds:.2f} s"]
        lines += ["  " + c.describe() for c in self.ranked[:n]]
        if self.rejected:
            lines.append("rejected (first few):")
            lines += ["  " + c.describe() for c in self.rejected[:n]]
        return "\n".join(lines)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _options(value, default: list) -> list:
    if value is None:
        return default
    if isinstance(value, int):
        return [value]
    return sorted(set(int(v) for v in value))


class _Pricer:
    """Prices one (pp, dp, tp) mesh's links and a LayerCosts at a row count."""

    def __init__(self, cost, axis_names, pp, dp, tp):
        self.cost = cost
        self.names = tuple(axis_names)
        self.mesh = Mesh(self.names, (pp, dp, tp))
        self.pp, self.dp, self.tp = pp, dp, tp

    def permute(self, nbytes: float) -> float:
        if self.pp == 1 or math.isinf(nbytes):
            return math.inf if math.isinf(nbytes) else 0.0
        return self.cost.collective_time(nbytes, "permute", (self.names[0],), self.mesh)

    def grad_sync(self, grad_bytes: float) -> float:
        if self.dp == 1 or grad_bytes <= 0:
            return 0.0
        from ..cost import wire_bytes
        return self.cost.collective_time(wire_bytes("all_reduce", grad_bytes, self.dp), "all_reduce",
                                         (self.names[1],), self.mesh)


def _stage_sync(costs: LayerCosts, pricer: _Pricer, cuts: StageCuts) -> float:
    """The slowest device's gradient all-reduce plus optimizer update after the drain."""
    per_rank: dict = {}
    for k, (a, b) in enumerate(cuts.bounds):
        d = k % pricer.pp
        g, u = per_rank.get(d, (0.0, 0.0))
        per_rank[d] = (g + sum(costs.grad_bytes[a:b]), u + sum(costs.update_s[a:b]))
    return max(pricer.grad_sync(g) + u for g, u in per_rank.values())


def _device_memory(cuts: StageCuts, p: int) -> float:
    per_rank: dict = {}
    for k, mem in enumerate(cuts.memory):
        per_rank[k % p] = per_rank.get(k % p, 0.0) + mem
    return max(per_rank.values())


def _forward_fraction(fwd, bwd) -> float:
    f, t = sum(fwd), sum(fwd) + sum(bwd)
    return min(max(f / t, 1e-3), 1 - 1e-3) if t > 0 else 1 / 3


def search_pipeline(costs: Union[LayerCosts, Callable[[int], LayerCosts]], devices: int, batch: int, cost, *,
                    memory_limit: Optional[float] = None, pp=None, dp=None, tp=None, microbatches=None,
                    schedules: Sequence[str] = ("gpipe", "1f1b", "zero_bubble", "interleaved"),
                    virtual_stages: Sequence[int] = (2,), axis_names=("pp", "dp", "mp"),
                    max_microbatches: int = 64, finalists: int = 6, budget: int = 60) -> SearchResult:
    """The fastest configuration that fits (module docstring). ``costs``: one ``LayerCosts``
    (every tp alike) or ``tp -> LayerCosts`` (a ``ShardingError`` it raises rejects that
    tp); ``batch``: rows per step, all replicas together; ``pp``/``dp``/``tp``/
    ``microbatches``: None to search, a number to fix, or a list of options; ``budget``:
    simulations per finalist's cut search (``plan_cuts``)."""
    t0 = time.perf_counter()
    if not (isinstance(devices, int) and devices >= 1 and isinstance(batch, int) and batch >= 1):
        raise ShardingError(f"pipeline search: devices and batch must be positive integers, got {devices!r}, "
                            f"{batch!r}")
    unknown = set(schedules) - set(FLAT_SCHEDULES) - {"interleaved"}
    if unknown or not schedules:
        raise ShardingError(f"pipeline search: schedules must be among {FLAT_SCHEDULES + ('interleaved',)}, got "
                            f"{list(schedules)}")
    memo: dict = {}

    def costs_for(t: int):
        if t not in memo:
            try:
                memo[t] = costs if isinstance(costs, LayerCosts) else costs(t)
            except ShardingError as e:
                memo[t] = str(e).splitlines()[0]
        return memo[t]

    rejected, configs = [], []
    flat = [s for s in schedules if s in FLAT_SCHEDULES]
    for t in _options(tp, _divisors(devices)):
        for p in _options(pp, _divisors(devices)):
            if devices % (t * p):
                continue
            d = devices // (t * p)
            if dp is not None and d not in _options(dp, []):
                continue
            if devices != p * d * t:
                continue
            c = costs_for(t)
            if isinstance(c, str):
                rejected.append(Candidate(p, d, t, reason=f"the stage cannot be planned on tp={t}: {c}"))
                continue
            if p > c.layers:
                rejected.append(Candidate(p, d, t, reason=f"too few layers: {c.layers} layers for pp={p} stages"))
                continue
            if batch % d:
                rejected.append(Candidate(p, d, t, reason=f"divisibility: the batch of {batch} rows does not "
                                                          f"split over dp={d}"))
                continue
            per_replica = batch // d
            ms = _options(microbatches, [x for x in _divisors(per_replica) if x <= max_microbatches])
            for m in ms:
                if per_replica % m:
                    rejected.append(Candidate(p, d, t, m, reason=f"divisibility: {m} micro-batches do not divide "
                                                                 f"the {per_replica} rows of a replica"))
                    continue
                if flat:
                    configs.append((p, d, t, m, 1))
                if "interleaved" in schedules and p > 1:
                    for v in virtual_stages:
                        if v < 2:
                            continue
                        if m % p:
                            rejected.append(Candidate(p, d, t, m, "interleaved", v, reason=(
                                f"divisibility: interleaved needs micro-batches a multiple of pp={p}, got {m}")))
                        elif p * v > c.layers:
                            rejected.append(Candidate(p, d, t, m, "interleaved", v, reason=(
                                f"too few layers: {c.layers} layers for pp*v = {p * v} model stages")))
                        else:
                            configs.append((p, d, t, m, v))

    pricers: dict = {}

    def pricer(p, d, t) -> _Pricer:
        key = (p, d, t)
        if key not in pricers:
            pricers[key] = _Pricer(cost, axis_names, p, d, t)
        return pricers[key]

    # the layers' arrays for (tp, rows, pp mesh) are shared by every m and schedule that use them
    arrays: dict = {}

    def layer_arrays(p, d, t, m):
        rows = batch // (d * m)
        key = (p, d, t, rows)
        if key not in arrays:
            c = costs_for(t)
            fwd, bwd, act, ex = c.at_rows(rows)
            pr = pricer(p, d, t)
            arrays[key] = dict(layer_time=[f + b for f, b in zip(fwd, bwd)],
                               boundary_time=[pr.permute(x) for x in ex], param_bytes=list(c.state_bytes),
                               activation_bytes=list(act), forward_fraction=_forward_fraction(fwd, bwd))
        return arrays[key]

    def lower_bound(cfg) -> float:
        p, d, t, m, v = cfg
        a = layer_arrays(p, d, t, m)
        c = costs_for(t)
        return m * sum(a["layer_time"]) / p + pricer(p, d, t).grad_sync(sum(c.grad_bytes) / p) + sum(c.update_s) / p

    # ---- screening: the closed form's exact DP, in lower-bound order ----
    order = sorted(configs, key=lower_bound)
    screened, best_screen, pruned = [], math.inf, 0
    for n, cfg in enumerate(order):
        if lower_bound(cfg) > best_screen:
            pruned = len(order) - n
            break
        p, d, t, m, v = cfg
        name = "interleaved" if v > 1 else "1f1b"
        try:
            cuts = plan_cuts(schedule=name, p=p, m=m, v=v, memory_limit=memory_limit, objective="formula",
                             **layer_arrays(p, d, t, m))
        except ShardingError as e:
            rejected.append(Candidate(p, d, t, m, name if v > 1 else "any", v,
                                      reason="memory: " + str(e).splitlines()[0]))
            continue
        sync = _stage_sync(costs_for(t), pricer(p, d, t), cuts)
        cand = Candidate(p, d, t, m, name, v, cuts.formula_time + sync, cuts.formula_time, sync,
                         _device_memory(cuts, p), cuts)
        screened.append(cand)
        best_screen = min(best_screen, cand.step_s)
    screened.sort(key=lambda c: c.step_s)

    # ---- finalists: every schedule, with the simulator as the objective ----
    final = []
    for c0 in screened[:max(1, finalists)]:
        p, d, t, m, v = c0.pp, c0.dp, c0.tp, c0.microbatches, c0.virtual_stages
        for name in (["interleaved"] if v > 1 else flat):
            try:
                cuts = plan_cuts(schedule=name, p=p, m=m, v=v, memory_limit=memory_limit, objective="simulate",
                                 budget=budget, **layer_arrays(p, d, t, m))
            except ShardingError as e:
                rejected.append(Candidate(p, d, t, m, name, v, reason="memory: " + str(e).splitlines()[0]))
                continue
            sync = _stage_sync(costs_for(t), pricer(p, d, t), cuts)
            final.append(Candidate(p, d, t, m, name, v, cuts.simulated_time + sync, cuts.simulated_time, sync,
                                   _device_memory(cuts, p), cuts, simulated=True))
    final.sort(key=lambda c: (c.step_s, c.memory_bytes))
    done = {(c.pp, c.dp, c.tp, c.microbatches, c.virtual_stages) for c in final}
    ranked = final + [c for c in screened if (c.pp, c.dp, c.tp, c.microbatches, c.virtual_stages) not in done]
    seconds = time.perf_counter() - t0
    if not final:
        mem = [c for c in rejected if c.reason.startswith("memory")]
        why = (mem or rejected or [None])[0]
        # (the fix named is for what rejected them: memory, or the shapes the search was given)
        fix = ("raise the memory limit, allow more pipeline stages or tensor parallelism, or recompute activations"
               if mem else "give micro-batches, stages and a schedule that divide as the example says, or let the "
               "search choose them (microbatches=\"auto\", schedule=\"auto\")")
        raise (NoPipelineFits if mem else ShardingError)("pipeline search: no configuration fits" + (
            f" memory_limit={memory_limit:.6g} bytes" if memory_limit else "") + f" on {devices} devices"
            + (f"; for example {why.describe()}" if why else "") + "; " + fix)
    return SearchResult(final[0], ranked, rejected, pruned, len(screened), seconds)


def equal_layer_candidate(costs: LayerCosts, devices: int, batch: int, cost, *, pp: int, tp: int, microbatches: int,
                          schedule: str = "1f1b", virtual_stages: int = 1, axis_names=("pp", "dp", "mp"),
                          memory_limit: Optional[float] = None) -> Candidate:
    """The same configuration priced the same way with equal-layer cuts (``cuts.even_bounds``):
    the reference that automatic cuts are measured against."""
    from .cuts import even_bounds
    d = devices // (pp * tp)
    rows = batch // (d * microbatches)
    fwd, bwd, act, ex = costs.at_rows(rows)
    pr = _Pricer(cost, axis_names, pp, d, tp)
    cuts = evaluate_cuts(even_bounds(costs.layers, pp * virtual_stages), [f + b for f, b in zip(fwd, bwd)], pp,
                         microbatches, schedule, virtual_stages, boundary_time=[pr.permute(x) for x in ex],
                         param_bytes=costs.state_bytes, activation_bytes=act, memory_limit=memory_limit,
                         forward_fraction=_forward_fraction(fwd, bwd))
    sync = _stage_sync(costs, pr, cuts)
    return Candidate(pp, d, tp, microbatches, schedule, virtual_stages, cuts.simulated_time + sync,
                     cuts.simulated_time, sync, _device_memory(cuts, pp), cuts, simulated=True)


__all__ = ["LayerCosts", "Candidate", "SearchResult", "NoPipelineFits", "search_pipeline", "equal_layer_candidate"]
