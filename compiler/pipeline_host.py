"""The pipeline's host model on its own stage programs' figures: ``pstep.plan(*args, measure=True)``.

The host model (``pipeline_step.host_step``, ``mpmd_host_step``) needs two things of the
host: how long each stage's action takes on its rank's device alone, and how much work
the ranks get done when several run at once (forced CPU devices are threads sharing the
host's cores). ``shardprop calibrate`` measures both on its own programs (matmul chains,
fused loops) and the profile prices a stage from them; on the 2-core development host
the calibration's matmul, 4 at once, did 1.25-1.66 devices' work while the stage
programs did 0.82-1.12, and the figure moved by that much between calibrations a minute
apart (docs/results/pipeline.md). Fed the stage programs' own concurrency, the same
simulation put the MPMD step within 5% of the measured one. So here the plan measures
its own figures, when asked, as ``measure=True`` times the search's plans:

- **work alone** (``HostFigures.alone``): each (action kind, model stage)'s program as
  the lowering runs it, jitted on its rank's device and run ``m`` times back to back: for
  the MPMD lowering its equations plus the add of its partial sums into the accumulator
  (donated, as that lowering adds them: ``StageProgram``); for the SPMD lowering the tick
  loop's branch (its inputs unpacked from the slots and the packed state row, its
  outputs packed: ``BranchProgram``) and the add of its piece into the flat accumulator;
  each stage's once ops (the optimizer) once;
- **work done at once** (``HostFigures.at_once``): the first ``n`` ranks each running its
  stages' actions of every micro-batch in program order, dispatched from one thread in
  turns (the MPMD driver's way), for ``n = 2 .. p``. The figure is the ``Capacity`` point
  that makes the model's own processor sharing (``simulate.shared_time``) of those ranks'
  work alone end when the measured run ended (``fit_capacity``), so the simulation reads
  back what was measured rather than a ratio of sums that uneven stages would bias;
- **the driver** (``dispatch_s``, ``transfer_s``): calibrate's ``_driver_costs``;
- **the SPMD lowering's own cost** (``HostFigures.idle_loop``, ``lowering="spmd"``): the
  step's one program with every tick's action the no-op branch (``idle_loop_program``):
  the state unpacked, every tick's slot writes and exchanges, the once ops and the
  packing of the new state, on every rank at once. On the 2-core host that was 68 ms of
  a 276 ms 1F1B step at width 1024, work the stage programs alone do not show. And per
  rank the same program with only that rank's actions (``HostFigures.in_loop``): what its
  actions cost in the loop beyond its branches alone (1.17x under load 8: the
  accumulator's cond and the slot writes around each action), which scales that rank's
  actions (``in_loop_factor``).

Every program is timed in turns with the others, the median of ``reps`` rounds after a
warm-up, so a busy spell of the host hits them alike. ``pipeline_step.measured_host_step``
runs the host model's simulation (the SPMD lowering's lockstep ticks plus its idle loop,
or the MPMD driver's release times) on these figures in place of the profile's.

Only a mesh whose pipeline ranks are one device each is measured (a rank of several
devices runs collectives inside its programs); other meshes get a ``ShardingError``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from ..ir.errors import ShardingError
from .measure import MEASURE_REPS, median_steps

LEAST_CAPACITY = 0.05       # a fitted point never below this (ranks' work at once): a stall is not a rate


class _Repeated:
    """A program run ``times`` times back to back a call (``dispatch`` each, not waited
    for), then waited for."""
    times: int
    last = None

    def wait(self) -> None:
        jax.block_until_ready(self.last)

    def __call__(self) -> None:
        for _ in range(self.times):
            self.dispatch()
        self.wait()


class StageProgram(_Repeated):
    """Equations ``idxs`` of ``prog``'s micro-batch jaxpr jitted on ``device``: inputs what
    they read (zeros of their shapes), outputs ``outs``; with ``accs`` (partial sums) each
    call also adds them into accumulators it takes and returns, donated, as the lowering
    adds a backward's weight gradients. A call runs it ``times`` times back to back,
    feeding the accumulators on, without waiting; ``wait`` waits for the last."""

    def __init__(self, prog, idxs, outs, device, accs=(), times: int = 1):
        j = prog.j
        self.times, self.idxs = times, list(idxs)
        consts = dict(zip(j.constvars, prog.consts))
        reads = [v for v in prog._reads(self.idxs) if v not in consts]
        produced = {o for i in self.idxs for o in j.eqns[i].outvars}
        self.accs = [v for v in dict.fromkeys(accs) if v in produced]
        outs = [v for v in dict.fromkeys(outs) if v in produced and v not in set(self.accs)]
        nacc = len(self.accs)

        def run(*vals):
            env = dict(consts)
            env.update(zip(reads, vals[nacc:]))
            prog._run(self.idxs, env)
            return [a + env[v] for a, v in zip(vals[:nacc], self.accs)] + [env[v] for v in outs]
        self.fn = jax.jit(run, donate_argnums=tuple(range(nacc)))
        self.args = [jax.device_put(jnp.zeros(v.aval.shape, v.aval.dtype), device) for v in reads]
        self.acc = [jax.device_put(jnp.zeros(v.aval.shape, v.aval.dtype), device) for v in self.accs]
        self.last = None

    def dispatch(self) -> None:
        """One run, not waited for."""
        out = self.fn(*self.acc, *self.args)
        self.acc, self.last = list(out[:len(self.accs)]), out



class BranchProgram(_Repeated):
    """One action as the SPMD lowering's tick loop runs it (``prog._branch(key)``: its
    inputs unpacked from the slot rows, the packed state row and the micro-batch, the
    stage's equations, what it sends, keeps and accumulates packed), then its partial sums
    added into the accumulator (donated) as the loop adds them, on ``device``, on zeros
    and the step's replicated and batch inputs ``rep``, ``batch``. A call runs it
    ``times`` times back to back; ``dispatch`` and ``wait`` as ``StageProgram``'s."""

    def __init__(self, prog, key, device, rep, batch, times: int = 1):
        from jax import lax
        run, d, n = prog._branch(key), prog.rank_of(key[1]), prog.ACCK
        put = lambda x: jax.device_put(x, device)
        rows = tuple(put(jnp.zeros((size,), jnp.float32)) for size in (prog.A, prog.R, prog.G, prog.O))
        state_row = put(jnp.zeros((prog.state_size,), jnp.float32))
        hoisted = jax.jit(lambda s: prog.unpack_hoisted(s, d))(state_row)
        self.args = (rows, state_row, {i: put(np.asarray(x)) for i, x in rep.items()},
                     {i: put(np.asarray(x)) for i, x in batch.items()}, hoisted)
        accumulates = bool(prog.progs[key]["accs"])

        def one(acc, rows, state_row, rep, batch, hoisted):
            (resid_row, out_row), (piece, base), send_f, send_b = run((rows, jnp.int32(0), state_row, rep, batch,
                                                                       hoisted))
            if accumulates:
                acc = lax.dynamic_update_slice_in_dim(acc, lax.dynamic_slice_in_dim(acc, base, n) + piece, base, 0)
            return acc, resid_row, out_row, send_f, send_b
        self.fn = jax.jit(one, donate_argnums=0)
        self.acc = put(jnp.zeros((prog.ACC,), jnp.float32))
        self.times, self.last = times, None

    def dispatch(self) -> None:
        self.last = self.fn(self.acc, *self.args)
        self.acc = self.last[0]


def branch_programs(prog, devices, rep, batch) -> dict:
    """``stage_programs`` as the SPMD lowering runs them: each (kind, model stage)'s
    action a ``BranchProgram`` run ``prog.m`` times a call; the once ops as they are."""
    out = stage_programs(prog, devices)
    for k in range(prog.S):
        for kind in prog.kinds:
            out[(kind, k)] = BranchProgram(prog, (kind, k), devices[prog.rank_of(k)], rep, batch, prog.m)
    return out


def rank_devices(prog) -> list:
    """Per pipeline rank, its one device; a ``ShardingError`` where a rank has several."""
    devs = np.asarray(prog.mesh.devices)
    names = list(prog.mesh.axis_names)
    if devs.size != prog.p:
        others = {n: s for n, s in zip(names, devs.shape) if n != prog.axis}
        raise ShardingError(
            f"pipeline plan(measure=True): the host's figures are measured on each pipeline rank's one device, and "
            f"this mesh gives each of the {prog.p} ranks {devs.size // prog.p} devices (axes {others}), whose "
            f"programs hold collectives. Fix: measure the step on a mesh of the {prog.axis!r} axis alone "
            f"(mesh=(({prog.p},), ({prog.axis!r},))), or plan without measure=True (the profile's figures)")
    return list(np.moveaxis(devs, names.index(prog.axis), 0).reshape(-1))


def stage_programs(prog, devices, m: Optional[int] = None) -> dict:
    """``(kind, model stage)`` -> its action's ``StageProgram`` on its rank's device (what it
    sends, keeps for its backward and outputs; its partial sums added into accumulators),
    run ``m`` (default ``prog.m``) times a call; ``("once", model stage)`` -> its once ops
    (the new state), run once."""
    m = prog.m if m is None else m
    out = {}
    outvars = [v for v in prog.j.outvars if not isinstance(v, jcore.Literal)]
    for k in range(prog.S):
        dev = devices[prog.rank_of(k)]
        for kind in prog.kinds:
            pr = prog.progs[(kind, k)]
            keep = list(prog.resid[k].vars) if kind == "forward" else []
            out[(kind, k)] = StageProgram(prog, pr["idxs"], list(pr["sends"]) + list(pr["outs_b"]) + keep, dev,
                                          accs=pr["accs"], times=m)
        out[("once", k)] = StageProgram(prog, prog.once[k]["idxs"], outvars, dev)
    return out


class RanksAtOnce:
    """The first ``n`` ranks each running its stages' actions of every micro-batch (each
    micro-batch's actions in ``prog.kinds`` order, a rank's stages in order), dispatched
    from one thread in turns over the ranks, then waited for."""

    def __init__(self, prog, programs, n: int):
        self.m = prog.m
        self.per_rank = [[programs[(kind, k)] for k in range(prog.S) if prog.rank_of(k) == d for kind in prog.kinds]
                         for d in range(n)]

    def __call__(self) -> None:
        for _ in range(self.m):
            for actions in self.per_rank:
                for pr in actions:
                    pr.dispatch()
        for actions in self.per_rank:
            for pr in actions:
                pr.wait()


def fit_capacity(runs) -> tuple:
    """Capacity points ``((1, 1), (n, work), ...)`` from ``runs``: ``(n, works, seconds)``,
    ``n`` ranks whose work alone is ``works`` (seconds each) that ran at once in
    ``seconds``, in increasing ``n``. Each point is the one that, with the points below it,
    makes ``shared_time(works, Capacity(points))`` equal ``seconds`` (the simulation's own
    sharing, inverted): at most ``n`` (a run faster than its longest rank alone is noise,
    and no more than side by side), at least ``LEAST_CAPACITY``."""
    from scipy.optimize import brentq

    from ..passes.pipeline.simulate import Capacity, shared_time
    points = [(1, 1.0)]
    for n, works, seconds in runs:
        def miss(c):
            return float(shared_time(list(works), Capacity(tuple(points) + ((n, c),)))) - seconds
        hi, lo = float(n), LEAST_CAPACITY          # more capacity, an earlier end: miss falls with c
        if miss(hi) >= 0:
            c = hi
        elif miss(lo) <= 0:
            c = lo
        else:
            c = brentq(miss, lo, hi, xtol=1e-6)
        points.append((n, float(c)))
    return tuple(points)


def at_once_counts(p: int) -> list:
    """The rank counts measured at once: every count up to 4, then powers of two and ``p``."""
    return sorted({n for n in range(2, min(p, 4) + 1)} | {min(2 ** i, p) for i in range(1, p.bit_length() + 1)}
                  - {1})


@dataclass(frozen=True)
class HostFigures:
    """What ``measure_host`` measured of a pipeline's programs on this host (seconds).

    ``alone``: ``((kind, model stage), seconds of one action alone)``, per action;
    ``once``: per rank, its stages' once ops alone; ``at_once``: ``((n, ranks' work done),
    ...)``, the ``Capacity`` points fitted to ``runs``: ``(n, per rank its work alone, the
    seconds the n ranks took at once)``; ``dispatch_s``, ``transfer_s``: a Python driver's
    cost per program dispatched and per value moved; ``reps``: the medians' rounds;
    ``idle_loop``: the SPMD program with no action at any tick (None: not measured);
    ``in_loop``: per rank, the same program with that rank's actions only (() : not
    measured): its actions as the loop runs them, alone, beside the idle loop."""
    alone: tuple
    once: tuple
    at_once: tuple
    runs: tuple
    dispatch_s: float
    transfer_s: float
    reps: int
    idle_loop: Optional[float] = None
    in_loop: tuple = ()

    def in_loop_factor(self, prog) -> list:
        """Per rank, how much longer its actions take in the SPMD loop than its branch
        programs alone: (its loop alone, less the idle loop) over its actions alone, at
        least 1 (an action in the loop does at least its branch's work); 1 where not
        measured."""
        if not self.in_loop or self.idle_loop is None:
            return [1.0] * prog.p
        alone = dict(self.alone)
        out = []
        for d in range(prog.p):
            work = prog.m * sum(alone[(kind, k)] for k in range(prog.S) if prog.rank_of(k) == d for kind in prog.kinds)
            out.append(max(1.0, (self.in_loop[d] - self.idle_loop) / work) if work > 0 else 1.0)
        return out

    def loop_durations(self, prog) -> dict:
        """``durations`` with each rank's actions at their time in the SPMD loop
        (``in_loop_factor``)."""
        factor = self.in_loop_factor(prog)
        alone = dict(self.alone)
        return {kind: [alone[(kind, k)] * factor[prog.rank_of(k)] for k in range(prog.S)] for kind in prog.kinds}

    def durations(self, prog) -> dict:
        """The action times as ``simulate`` takes them: ``{kind: [seconds per model stage]}``."""
        alone = dict(self.alone)
        return {kind: [alone[(kind, k)] for k in range(prog.S)] for kind in prog.kinds}

    def capacity(self):
        from ..passes.pipeline.simulate import Capacity
        return Capacity(tuple(self.at_once))

    def text(self) -> str:
        alone = dict(self.alone)
        kinds = list(dict.fromkeys(kind for kind, _ in alone))
        stages = sorted({k for _, k in alone})
        lines = ["measured on this host (medians of %d rounds in turns):" % self.reps]
        for kind in kinds:
            lines.append(f"  {kind} alone per micro-batch: "
                         + " ".join(f"{alone[(kind, k)] * 1e3:.3f}" for k in stages) + " ms (per model stage)")
        lines.append("  once ops alone: " + " ".join(f"{t * 1e3:.2f}" for t in self.once) + " ms (per rank)")
        lines.append("  ranks at once -> ranks' work done: " + ", ".join(f"{n} -> {c:.2f}" for n, c in self.at_once)
                     + "  (from " + "; ".join(f"{n} ranks' {sum(w) * 1e3:.1f} ms of work alone in {s * 1e3:.1f} ms"
                                              for n, w, s in self.runs) + ")")
        lines.append(f"  driver: {self.dispatch_s * 1e6:.1f} us per program dispatched, "
                     f"{self.transfer_s * 1e6:.1f} us per value moved")
        if self.idle_loop is not None:
            lines.append(f"  the SPMD program with no action at any tick: {self.idle_loop * 1e3:.2f} ms")
        if self.in_loop:
            lines.append("  with one rank's actions only: " + " ".join(f"{t * 1e3:.1f}" for t in self.in_loop)
                         + " ms (per rank)")
        return "\n".join(lines)


def idle_loop_program(prog, run, acting=()):
    """The SPMD lowering's step with every tick's action the no-op branch, except on the
    ranks ``acting``: a copy of ``prog`` whose action tables are 0 on the other ranks (its
    exchange flags, slots and once phase kept), built by ``run(copy)`` (the caller's inputs
    and build), which returns a zero-argument callable that runs it once and waits. With
    one rank acting, that rank's actions run in the loop as they do in the step, alone."""
    import copy
    idle = copy.copy(prog)
    keep = np.zeros(prog.tables["act"].shape, bool)
    keep[:, list(acting)] = True
    idle.tables = dict(prog.tables, act=np.where(keep, prog.tables["act"], 0), acc=np.where(keep, prog.tables["acc"], 0))
    return run(idle)


def measure_host(prog, reps: int = MEASURE_REPS, programs: Optional[dict] = None, idle_loop=None,
                 rank_loops=None) -> HostFigures:
    """Time ``prog``'s stage programs alone and its ranks' programs at once on this host
    (the module doc); ``programs``: ``stage_programs``' result, where already built;
    ``idle_loop``: a zero-argument callable (``idle_loop_program``) timed in the same
    turns, and ``rank_loops``, per rank, the same with that rank acting, for the SPMD
    lowering."""
    from .calibrate import _driver_costs
    devices = rank_devices(prog)
    programs = stage_programs(prog, devices) if programs is None else programs
    counts = at_once_counts(prog.p) if prog.p > 1 else []
    fns = dict(programs)
    for n in counts:
        fns[("at once", n)] = RanksAtOnce(prog, programs, n)
    if idle_loop is not None:
        fns["idle loop"] = idle_loop
    for d, fn in enumerate(rank_loops or ()):
        fns[("rank loop", d)] = fn
    # (each a callable that runs its programs and waits: no inputs to make)
    med = dict(zip(fns, median_steps([(f, tuple) for f in fns.values()], reps)))
    alone = tuple(((kind, k), med[(kind, k)] / prog.m) for k in range(prog.S) for kind in prog.kinds)
    once = tuple(sum(med[("once", k)] for k in range(prog.S) if prog.rank_of(k) == d) for d in range(prog.p))
    rank_work = [sum(med[(kind, k)] for k in range(prog.S) if prog.rank_of(k) == d for kind in prog.kinds)
                 for d in range(prog.p)]
    runs = tuple((n, tuple(rank_work[:n]), med[("at once", n)]) for n in counts)
    dispatch_s, transfer_s = _driver_costs(devices, reps)
    in_loop = tuple(med[("rank loop", d)] for d in range(len(rank_loops or ())))
    return HostFigures(alone, once, fit_capacity(runs), runs, dispatch_s, transfer_s, reps, med.get("idle loop"),
                       in_loop)
