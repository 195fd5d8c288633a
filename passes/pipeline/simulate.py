"""Run a pipeline schedule's per-stage orders against durations: the event simulator.

``simulate(schedule, durations=None, latency=0)`` starts every action as soon as its
stage is free (stages run their lists in order, one action at a time) and its inputs
have arrived, and returns a :class:`SimResult`: the makespan, every action's start and
end, the tick table, the bubble, per-stage busy time and peak activations in flight.

Dependencies (model stage ``s = chunk*p + stage``, ``S = p*v`` model stages):

- F(i) at ``s`` waits for F(i) at ``s-1`` (for ``s > 0``);
- B(i) or I(i) at ``s`` waits for F(i) at ``s`` and, for ``s < S-1``, for the backward
  (B or its input half I) of micro-batch ``i`` at ``s+1`` (for ``s == S-1`` the loss is
  computed there, so only its own forward);
- W(i) at ``s`` waits for I(i) at ``s``.

With ``v > 1`` the edge from model stage ``c*p + p-1`` to ``(c+1)*p`` is the wrap-around
from stage ``p-1`` to stage 0. An edge between two different stages is delayed by the
exchange ``latency`` of that model-stage boundary (none within one stage).

Durations (``durations=``): ``None`` is unit cost, F = 1, B = 2, I = W = 1 (the ZB paper's
F = B = W = 1 with 1F1B's whole backward B = I + W = 2). Otherwise a mapping from kind to
a number or to a sequence with one number per model stage (missing kinds: F = 1,
I = W = B/2, B = I + W), or a callable ``(kind, model_stage) -> number``. ``latency`` is a
number or a sequence of ``S-1`` numbers, one per boundary (boundary ``b`` is between model
stages ``b`` and ``b+1``, used by the F exchange and by the returning gradient).

**Shared cores** (``cores=``): ``None`` (the default) runs the stages side by side, each at
its full rate. A number ``c`` models ranks that share ``c`` cores (forced CPU devices, all
threads of one host): at any moment the ``n`` stages running an action each progress at
``min(1, c / n)`` of their rate (processor sharing), so an action of duration ``t`` takes
``t`` alone and longer while more than ``c`` stages run. ``c`` counts rank-sized cores
(a host's cores over the devices a rank's action keeps busy) and may be a Fraction, or a
:class:`Capacity`: the cores' worth of work measured at several counts of ranks running
(a host whose throughput does not grow as a fixed number of cores would give), each of
the ``n`` running then at ``min(1, capacity(n) / n)``. With
``c >= p`` nothing is shared and the result is the side-by-side one. A :class:`CoreShare`
prices what each running action uses instead of counting ranks: an action that alone keeps
``u`` cores busy (XLA:CPU runs one program on several threads where its ops are large
enough) demands ``u``, and the running actions all progress at ``CoreShare.rate`` of the
demands. Latencies are delays
that use no core. :func:`shared_time` is the same sharing for independent jobs that start
together (each rank's once ops after the loop), :func:`shared_finish` for jobs that start
at given times, and :func:`lockstep_time` for a tick loop run in lockstep (the SPMD
lowering's: each tick's actions share the cores and the tick ends with its slowest).

**Release times** (``release=``): a callable ``(stage, action) -> time`` before which the
action may not start, whatever its inputs (a driver that issues the actions one after
another: the MPMD lowering's); ``None``, every action may start at 0.

Arithmetic is exact: ints and Fractions stay Fractions; with any float input it runs in
floats. A schedule that cannot proceed raises :class:`DeadlockError` naming each stuck
stage's next action and what it waits for.

The **tick table** (``SimResult.tick_table``) maps ``(tick, stage) -> Action`` for every
tick slot an action occupies, ticks measured in ``SimResult.tick`` (the greatest common
divisor of the durations and latencies; 1 for unit costs). The SPMD lowering consumes the
unit-cost table: a scan over ticks in which each rank runs the action at ``(tick, rank)``
or nothing. ``SimResult.render()`` draws it as text (one row per stage).

Bubble conventions: ``bubble`` is idle time over ``p * makespan`` (the fraction of the
step the stages idle, (p-1)/(m+p-1) for GPipe and 1F1B at unit costs);
``idle_time`` is the total idle stage-time; ``bubble_ratio`` is idle over busy time, the
zero-bubble paper's convention (1F1B: (p-1)/m). Busy time is wall time spent in actions,
so with shared cores it includes the slowdown; ``work`` is each stage's durations summed.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

from ...ir.errors import ShardingError
from .schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, KINDS, Action,
                        Schedule)

DEFAULT_DURATIONS = {FORWARD: 1, BACKWARD: 2, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 1}
MAX_TICKS = 1_000_000


class DeadlockError(ShardingError):
    """A schedule whose orders cannot all run. ``stuck`` lists, per stage that still has
    work, ``(stage, action, [(stage, action) it waits for, ...])``."""

    def __init__(self, message: str, stuck: list):
        super().__init__(message)
        self.stuck = stuck


@dataclass(frozen=True)
class Capacity:
    """What ``n`` ranks running at once get done, in ranks' work alone, at each ``n``:
    ``points`` ``((n, work), ...)`` as measured, linear between them, flat past the last,
    never more than ``n``. (Below 1 at ``n = 1`` where a rank's own devices slow each
    other: a rank of two forced devices on a host that runs one at a time.)"""
    points: tuple

    def __call__(self, n):
        pts = sorted(self.points)
        if n <= pts[0][0]:
            c = pts[0][1]
        elif n >= pts[-1][0]:
            c = pts[-1][1]
        else:
            (n0, c0), (n1, c1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= n <= b[0])
            c = c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        return min(n, c)

    def __float__(self) -> float:
        return float(self(max(n for n, _ in self.points)))

    def shares(self, p: int) -> bool:
        """Whether ``p`` ranks or fewer ever run below their alone rate."""
        return any(self(n) < n for n in range(1, p + 1))


@dataclass(frozen=True)
class CoreShare:
    """Ranks sharing a host's cores, each running action priced by the cores it keeps busy
    alone. ``capacity``: what the host got done with ``n`` programs of ``unit`` cores each
    running (a number or a :class:`Capacity` over ``n``, in those programs' work alone, as
    ``shardprop calibrate`` measures ``at_once``); ``use(stage, action)``: the cores that
    action keeps busy alone (a callable; None: ``unit`` each); ``once``: per rank, the
    cores its once ops keep busy alone (``unit`` each where absent).

    Running actions demanding ``D`` cores in all (their uses summed) each progress at
    ``min(1, delivered / D)``, where the host delivers ``unit * capacity(D / unit)`` cores
    (the measured curve read at as many of its programs as demand as much), never less than
    the largest one running uses (an action alone runs at its own rate, by the definition
    of its price). With every use equal to ``unit`` that is ``capacity(n) / n`` for ``n``
    running, the rank-counting model."""
    capacity: object
    unit: float
    use: object
    once: tuple = ()

    def action_use(self, stage: int, action) -> float:
        """The cores ``action`` on ``stage`` keeps busy alone."""
        return self.use(stage, action) if self.use is not None else self.unit

    def once_uses(self, n: int) -> list:
        """The cores each of ``n`` ranks' once ops keep busy alone."""
        return list(self.once[:n]) + [self.unit] * (n - len(self.once))

    def rate(self, uses) -> float:
        """How fast each of the running actions that use ``uses`` cores alone progresses."""
        demand = float(sum(uses))
        if demand <= 0:
            return 1.0
        delivered = self.unit * float(_capacity(self.capacity, demand / self.unit))
        return min(1.0, max(delivered, max(uses)) / demand)


def _share_rate(cores, uses: list):
    """How fast each running job progresses on ``cores``: ``uses``, one per running job,
    the cores it keeps busy alone (read by a ``CoreShare``; other cores count the jobs)."""
    if not uses:
        return 1
    if isinstance(cores, CoreShare):
        return cores.rate(uses)
    return min(1, _capacity(cores, len(uses)) / len(uses))


def _capacity(cores, n):
    """Rank-sized cores ``n`` running ranks share: ``cores`` itself, or a Capacity's at n."""
    return cores(n) if isinstance(cores, Capacity) else cores


def _check_cores(cores):
    if isinstance(cores, CoreShare):
        _check_cores(cores.capacity)
        bad = ((cores.use is not None and not callable(cores.use)) or not cores.unit > 0
               or any(not isinstance(u, numbers.Real) or not u > 0 for u in cores.once))
    elif isinstance(cores, Capacity):
        bad = not cores.points or any(isinstance(x, bool) or not isinstance(x, numbers.Real) or not x > 0
                                      or not math.isfinite(x) for pt in cores.points for x in pt)
    else:
        bad = (isinstance(cores, bool) or not isinstance(cores, numbers.Real) or not cores > 0
               or not math.isfinite(cores))
    if bad:
        raise ShardingError(f"pipeline simulation: cores must be a finite number > 0, a Capacity of such "
                            f"points, a CoreShare of such a capacity and positive uses, or None, got {cores!r}")


def _core_values(cores) -> list:
    """The numbers in ``cores`` (for exact arithmetic's check)."""
    if cores is None:
        return []
    if isinstance(cores, CoreShare):   # uses are measured figures: the simulation runs in floats
        return [float(cores.unit)]
    return [x for pt in cores.points for x in pt] if isinstance(cores, Capacity) else [cores]


@dataclass(frozen=True)
class Event:
    stage: int
    action: Action
    start: object
    end: object


@dataclass
class SimResult:
    schedule: Schedule
    events: list                      # Event per action, in start order per stage
    makespan: object
    busy: tuple                       # per stage, time spent running actions
    peak_in_flight: tuple             # per stage, activations held at once (Schedule.peak_in_flight)
    peak_pending_weight: tuple        # per stage, input-gradients whose weight-gradient waits
    tick: object                      # one tick of the tick table, in duration units
    work: tuple = ()                  # per stage, its actions' durations summed (busy time at full rate)
    cores: object = None              # the shared cores simulated (None: side by side)
    _table: Optional[dict] = field(default=None, repr=False)

    @property
    def p(self) -> int:
        return self.schedule.p

    @property
    def idle_time(self):
        return self.p * self.makespan - sum(self.busy)

    @property
    def bubble(self):
        """Idle stage-time over ``p * makespan``."""
        return self.idle_time / (self.p * self.makespan) if self.makespan else 0

    @property
    def bubble_ratio(self):
        """Idle stage-time over busy stage-time (the zero-bubble paper's convention)."""
        busy = sum(self.busy)
        return self.idle_time / busy if busy else 0

    def at(self, tick: int, stage: int) -> Optional[Action]:
        """The action ``stage`` runs at ``tick``, or None (a bubble)."""
        return self.tick_table.get((tick, stage))

    def span(self, stage: int, action: Action) -> tuple:
        """(start, end) of ``action`` on ``stage``."""
        for e in self.events:
            if e.stage == stage and e.action == action:
                return e.start, e.end
        raise KeyError((stage, action))

    @property
    def ticks(self) -> int:
        """Length of the tick table."""
        return int(self.makespan / self.tick) if self.tick else 0

    @property
    def tick_table(self) -> dict:
        """``(tick, stage) -> Action`` for every tick an action occupies (idle slots absent)."""
        if self._table is None:
            if self.ticks > MAX_TICKS:
                raise ShardingError(
                    f"the tick table would have {self.ticks} ticks of {self.tick}: the durations are not "
                    f"commensurate; give durations that are multiples of one tick (ints or Fractions)")
            table = {}
            for e in self.events:
                for t in range(int(e.start / self.tick), int(e.end / self.tick)):
                    table[(t, e.stage)] = e.action
            self._table = table
        return self._table

    def table(self) -> list:
        """The tick table as rows, one per tick, of ``p`` entries (Action or None)."""
        tt = self.tick_table
        return [tuple(tt.get((t, d)) for d in range(self.p)) for t in range(self.ticks)]

    def render(self, width: int = 0) -> str:
        """One text row per stage, one cell per tick: ``F3``, ``B3``, ``I3``, ``W3``
        (``.c`` for chunk c), ``.`` for idle."""
        tt = self.tick_table
        width = width or max([len(str(a)) for a in tt.values()] + [1])
        rows = []
        for d in range(self.p):
            cells = [str(tt[(t, d)]) if (t, d) in tt else "." for t in range(self.ticks)]
            rows.append(f"stage {d}: " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(rows)


def _exact(values) -> bool:
    """Rational inputs only (ints, Fractions, numpy ints): simulate in Fractions."""
    return all(isinstance(x, numbers.Rational) for x in values)


def _num(x, exact: bool):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ShardingError(f"pipeline simulation: a duration or latency must be a number, got {x!r}")
    if not (x >= 0 and math.isfinite(x)):
        raise ShardingError(f"pipeline simulation: durations and latencies must be finite and >= 0, got {x!r}")
    return Fraction(int(x.numerator), int(x.denominator)) if exact else float(x)


def _per_stage(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ShardingError(f"pipeline simulation: {what} has {len(value)} entries, expected {n}")
        return list(value)
    return [value] * n


def _duration_table(durations, S: int) -> tuple:
    """kind -> per-model-stage list of raw numbers."""
    if durations is None:
        return {k: [v] * S for k, v in DEFAULT_DURATIONS.items()}
    if callable(durations):
        return {k: [durations(k, s) for s in range(S)] for k in KINDS}
    unknown = set(durations) - set(KINDS)
    if unknown:
        raise ShardingError(f"pipeline simulation: unknown duration kinds {sorted(unknown)}; use {KINDS}")
    table = {k: _per_stage(v, S, f"durations[{k!r}]") for k, v in durations.items()}
    table.setdefault(FORWARD, [1] * S)
    if BACKWARD in table:
        half = [b / 2 if isinstance(b, float) else Fraction(b) / 2 for b in table[BACKWARD]]
        table.setdefault(BACKWARD_INPUT, half)
        table.setdefault(BACKWARD_WEIGHT, half)
    else:
        table.setdefault(BACKWARD_INPUT, [1] * S)
        table.setdefault(BACKWARD_WEIGHT, [1] * S)
        table[BACKWARD] = [i + w for i, w in zip(table[BACKWARD_INPUT], table[BACKWARD_WEIGHT])]
    return table


def _gcd(values):
    g = Fraction(0)
    for x in values:
        x = Fraction(x)
        if x:
            g = Fraction(math.gcd(g.numerator * x.denominator, x.numerator * g.denominator),
                         g.denominator * x.denominator)
    return g


def simulate(schedule: Schedule, durations=None, latency=0, cores=None, release=None) -> SimResult:
    """Run ``schedule`` (see the module docstring for durations, latency, shared cores,
    release times and results)."""
    p, S = schedule.p, schedule.model_stages
    raw = _duration_table(durations, S)
    lat_raw = _per_stage(latency, max(S - 1, 0), "latency")
    if cores is not None:
        _check_cores(cores)
    shared = cores is not None and (isinstance(cores, CoreShare) or
                                    (cores.shares(p) if isinstance(cores, Capacity) else cores < p))
    released = {(d, a): release(d, a) for d, order in enumerate(schedule.orders) for a in order} if release else {}
    exact = _exact([x for v in raw.values() for x in v] + lat_raw + (_core_values(cores) if shared else [])
                   + list(released.values()))
    dur = {k: [_num(x, exact) for x in v] for k, v in raw.items()}
    lat = [_num(x, exact) for x in lat_raw]
    zero = Fraction(0) if exact else 0.0
    released = {key: _num(t, exact) for key, t in released.items()}
    start_at = lambda d, a: released.get((d, a), zero)

    # where each (kind, micro-batch, model stage) runs; "bwd" names B or I (what s-1 waits for)
    where = {}
    for d, order in enumerate(schedule.orders):
        for a in order:
            s = schedule.model_stage(d, a.chunk)
            where[(a.kind, a.microbatch, s)] = d
            if a.is_backward:
                where[("bwd", a.microbatch, s)] = (d, a)

    def deps(d: int, a: Action) -> list:
        """[(stage, action, latency)] that ``a`` on stage ``d`` waits for."""
        s, i = schedule.model_stage(d, a.chunk), a.microbatch
        out = []
        if a.kind == FORWARD:
            if s > 0:
                ds, c = schedule.placement(s - 1)
                out.append((ds, Action(FORWARD, i, c), lat[s - 1] if ds != d else zero))
        elif a.is_backward:
            out.append((d, Action(FORWARD, i, a.chunk), zero))
            if s < S - 1:
                ds, prev = where.get(("bwd", i, s + 1), (None, None))
                if prev is None:
                    raise ShardingError(f"schedule {schedule.name!r}: {a} on stage {d} needs the backward of "
                                        f"micro-batch {i} at model stage {s + 1}, which no stage runs")
                out.append((ds, prev, lat[s] if ds != d else zero))
        else:
            out.append((d, Action(BACKWARD_INPUT, i, a.chunk), zero))
        return out

    def length(d: int, a: Action):
        return dur[a.kind][schedule.model_stage(d, a.chunk)]

    if shared:
        events, end, pos = _run_shared(schedule, deps, length, _exact_cores(cores, exact), zero, start_at)
    else:
        events, end, pos = _run_side_by_side(schedule, deps, length, zero, start_at)

    if any(pos[d] < len(o) for d, o in enumerate(schedule.orders)):
        _deadlock(schedule, deps, end, pos)

    busy = tuple(sum((e.end - e.start for e in events if e.stage == d), zero) for d in range(p))
    work = tuple(sum((length(e.stage, e.action) for e in events if e.stage == d), zero) for d in range(p))
    makespan = max((e.end for e in events), default=zero)
    used = [dur[k][s] for k in {a.kind for o in schedule.orders for a in o} for s in range(S)]
    # shared cores and release times put actions off the durations' grid: the tick divides every event's time too
    stamps = [t for e in events for t in (e.start, e.end)] if shared or released else []
    tick = _gcd(used + lat + stamps) if exact else _gcd([Fraction(x) for x in used + lat + stamps])
    if not exact:
        tick = float(tick)
    events.sort(key=lambda e: (e.stage, e.start))
    return SimResult(schedule, events, makespan, busy, schedule.peak_in_flight(),
                     schedule.peak_pending_weight(), tick, work, cores if shared else None)


def _run_side_by_side(schedule, deps, length, zero, start_at):
    """Every stage at its full rate: each action starts when its stage is free, its
    inputs have arrived and it is released, and ends its duration later."""
    p = schedule.p
    end = {}
    stage_time = [zero] * p
    pos = [0] * p
    events = []
    progress = True
    while progress:
        progress = False
        for d, order in enumerate(schedule.orders):
            while pos[d] < len(order):
                a = order[pos[d]]
                ready = max(stage_time[d], start_at(d, a))
                for ds, dep, delay in deps(d, a):
                    if (ds, dep) not in end:
                        break
                    ready = max(ready, end[(ds, dep)] + delay)
                else:
                    finish = ready + length(d, a)
                    end[(d, a)] = finish
                    events.append(Event(d, a, ready, finish))
                    stage_time[d] = finish
                    pos[d] += 1
                    progress = True
                    continue
                break
    return events, end, pos


def _deadlock(schedule, deps, end, pos):
    p, stuck, lines = schedule.p, [], []
    for d, order in enumerate(schedule.orders):
        if pos[d] < len(order):
            a = order[pos[d]]
            missing = [(ds, dep) for ds, dep, _ in deps(d, a) if (ds, dep) not in end]
            stuck.append((d, a, missing))
            lines.append(f"  stage {d} waits at {a} for " + ", ".join(
                f"{dep} on stage {ds}" for ds, dep in missing))
    done = sum(pos)
    total = sum(len(o) for o in schedule.orders)
    raise DeadlockError(
        f"schedule {schedule.name!r} (p={p}, m={schedule.m}, v={schedule.v}) deadlocks after {done} of "
        f"{total} actions:\n" + "\n".join(lines) +
        "\n  fix: reorder the stages' lists so that each waited-for action comes earlier", stuck)


def _run_shared(schedule, deps, length, cores, zero, start_at):
    """Processor sharing: the stages running an action at a moment share ``cores``; each
    progresses at ``min(1, cores / running)`` of its rate. Time advances from event to event
    (an action's end, or an input's arrival after its latency)."""
    p = schedule.p
    end, events = {}, []
    pos = [0] * p
    free_at = [zero] * p                  # when each stage's last action ended
    running = {}                          # stage -> [action, start, work left]
    now = zero
    while True:
        waits = []                        # times at which a stage's next inputs arrive
        for d, order in enumerate(schedule.orders):
            if d in running or pos[d] >= len(order):
                continue
            a = order[pos[d]]
            ready = max(free_at[d], start_at(d, a))
            for ds, dep, delay in deps(d, a):
                if (ds, dep) not in end:
                    break
                ready = max(ready, end[(ds, dep)] + delay)
            else:
                if ready <= now:
                    running[d] = [a, now, length(d, a)]
                else:
                    waits.append(ready)
        if not running and not waits:
            return events, end, pos
        rate = _share_rate(cores, [cores.action_use(d, a) if isinstance(cores, CoreShare) else 1
                                   for d, (a, _, _) in running.items()])
        finishes = {d: now + left / rate for d, (_, _, left) in running.items()}
        nxt = min(list(finishes.values()) + waits)
        step = nxt - now
        for d in list(running):
            a, start, left = running[d]
            if finishes[d] <= nxt or _negligible(left - step * rate, left):
                end[(d, a)] = nxt
                events.append(Event(d, a, start, nxt))
                free_at[d] = nxt
                pos[d] += 1
                del running[d]
            else:
                running[d][2] = left - step * rate
        now = nxt


def _negligible(rest, whole) -> bool:
    """Work left that float rounding leaves (exact Fractions leave none)."""
    return isinstance(rest, float) and rest <= 1e-12 * max(abs(whole), 1.0)


def _exact_cores(cores, exact: bool):
    """``cores`` with its numbers as the simulation computes (Fractions or floats)."""
    if isinstance(cores, CoreShare):
        return cores
    if isinstance(cores, Capacity):
        return Capacity(tuple((_num(n, exact), _num(c, exact)) for n, c in cores.points))
    return _num(cores, exact)


def shared_finish(jobs, cores=None, uses=None):
    """When the last of independent jobs ``(start, work)`` ends on ranks that share
    ``cores`` (``None``: side by side), processor sharing as in ``simulate``: between two
    events (a start or an end) the ``n`` jobs running each progress at ``min(1, cores / n)``
    (for a ``CoreShare``, at its rate of the running jobs' uses: job ``i`` uses
    ``uses[i]`` cores alone where given, else ``cores.once[i]``, its ``unit`` where it
    gives none)."""
    jobs = list(jobs)
    exact = _exact([x for j in jobs for x in j] + _core_values(cores))
    if uses is None:
        uses = cores.once_uses(len(jobs)) if isinstance(cores, CoreShare) else [1] * len(jobs)
    uses = list(uses)
    order = sorted(range(len(jobs)), key=lambda i: (_num(jobs[i][0], exact), _num(jobs[i][1], exact)))
    uses = [uses[i] for i in order]
    jobs = [(_num(jobs[i][0], exact), _num(jobs[i][1], exact)) for i in order]
    if cores is not None:
        _check_cores(cores)
        cores = _exact_cores(cores, exact)
    zero = Fraction(0) if exact else 0.0
    now, left, running = zero, {}, 0          # left: job index -> work left
    end = max((s for s, _ in jobs), default=zero)
    while running < len(jobs) or left:
        while running < len(jobs) and jobs[running][0] <= now:
            if jobs[running][1] > 0:
                left[running] = jobs[running][1]
            running += 1
        if not left:
            if running < len(jobs):
                now = jobs[running][0]
                continue
            break
        rate = 1 if cores is None else _share_rate(cores, [uses[i] for i in left])
        nxt = now + min(left.values()) / rate
        if running < len(jobs):
            nxt = min(nxt, jobs[running][0])
        step = nxt - now
        for i in list(left):
            left[i] -= step * rate
            if left[i] <= 0 or _negligible(left[i], jobs[i][1]):
                del left[i]
        now = nxt
        end = max(end, now)
    return end


def shared_time(works, cores=None, uses=None):
    """Time for independent jobs of durations ``works`` that start together on ranks that
    share ``cores`` (``None``: side by side, the longest job): ``shared_finish`` with every
    job starting at 0 (``uses``: per job, the cores it keeps busy alone, for a
    ``CoreShare``)."""
    return shared_finish([(0, w) for w in works], cores, uses)


def lockstep_time(ticks, cores=None, latency=0):
    """The makespan of a tick loop run in lockstep (the SPMD lowering's: after each tick
    every rank meets the others in the exchanges, so a tick ends when its slowest action
    has): ``ticks``, per tick the ``(work, use)`` of each action run in it (``use``: the
    cores it keeps busy alone, read by a ``CoreShare``; else ignored), the actions of a
    tick sharing ``cores`` as ``shared_time`` shares them; plus ``latency`` per tick (a
    number, or one per tick: the exchanges that tick runs)."""
    lat = list(latency) if isinstance(latency, (list, tuple)) else [latency] * len(ticks)
    if len(lat) != len(ticks):
        raise ShardingError(f"pipeline simulation: {len(lat)} latencies for {len(ticks)} ticks")
    total = 0
    for actions, delay in zip(ticks, lat):
        total += delay
        if actions:
            total += shared_time([w for w, _ in actions], cores, [u for _, u in actions])
    return total
