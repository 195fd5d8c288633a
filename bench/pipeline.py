"""Pipeline parallelism on 8 forced CPU devices: issue 26's four criteria, measured.

An MLP training step (Adam) with a ``stage_boundary`` after every ``layers / (pp*v)``
layers, run on one device and pipelined on ``pp`` ranks. The forced CPU devices share
this machine's cores, so a rank that idles frees a core for the others: wall-clock idle
time is not the bubble. What the CPU can show, each figure next to its target:

1. **work on bubble ticks**: the no-op branch of the compiled tick loop only moves
   buffers (``runtime/pipeline_lower.py`` ``bubble_computes_nothing``), per schedule;
2. **step time against the sum of the stages' work**: the pipelined step against
   ``m`` times each stage's forward and backward programs plus its once ops (the
   optimizer), each program jitted alone on its rank's device of this process, its own
   equations and the add of its partial sums into its accumulator (no packing, no
   exchange: ``compiler/pipeline_host.py`` ``stage_programs``). Same process, same XLA CPU threading as the
   one-device step of the same model, which is printed beside it (on this machine a
   jitted program runs on one thread whether or not other devices are busy: see
   docs/results/pipeline.md). Target: at most 1.10;
3. **1F1B's compiled peak below GPipe's**, activations near ``p/m`` of GPipe's: the
   compiled programs' temp bytes (``memory_analysis()``) and the activation slot buffers
   (slots x the stage input, the kept forward values and the cotangent);
4. **step time against the cost model's**: the model of what runs here, the plan's
   ``host_step_time`` with ``plan(*args, measure=True)`` (``compiler/pipeline_host.py``):
   as the plan is made, each stage action's program is timed alone on its rank's device
   and the first n ranks' programs at once (n = 2..p), and the host model simulates those
   figures: for the SPMD lowering its tick loop in lockstep (``spmd_step``), then the
   ranks' once ops sharing the host; for the MPMD lowering the tick table with each
   action released when the Python driver has issued it (``mpmd_step``, at the measured
   dispatch and transfer costs). Target: within 20%. Each row prints the parts (work
   alone, the ranks' work done at once) as the plan measured them beside the same figures
   timed in this run's turns, the model fed this run's figures, and for SPMD the plan's
   figures simulated event by event instead of in lockstep; and beside it the profile's
   host model (``--cost-model``, default the built-in ``"cpu"``: its ``alone`` rates and
   ``at_once`` curve, ``core_share``). Above the rows: per action kind, the cores each
   stage program keeps busy alone (CPU over wall seconds) and the ranks' programs of that
   kind at once (``Together``) against them alone.

Every time is a median over ``--reps`` repetitions, taken round-robin over every
program (one-device step, each schedule, each stage program), so that the machine's load
drifts over all of them alike.

    python bench/pipeline.py                                   # width 1024, 8 layers, batch 256, pp 4, m 8
    python bench/pipeline.py --out bench/results/pipeline.txt
    python bench/pipeline.py --breakdown                       # also: where the gap goes (docs/results/pipeline.md)
    python bench/pipeline.py --heavy-cuts 3,5,6 2,4,6 1,3,5    # stages of unequal sizes (below)

Each schedule runs twice by default (``--lowerings spmd mpmd``): ``Pipeline(lowering=
"spmd")``, the one SPMD program (the tick loop: criteria 1 and 3 read its compiled HLO),
and ``lowering="mpmd"``, one program per stage action driven from Python
(``runtime/pipeline_mpmd.py``), labelled ``<schedule> mpmd``; criteria 2 and 4 are
printed for both, and criterion 1 for MPMD counts the programs the driver dispatches
against the tick table's actions.

``--heavy-cuts`` times instead ``bench/pipeline_cuts.py``'s model (6 light layers then 2
heavy ones 8x wider, width 256, batch 128) pipelined with 1F1B on ``pp`` ranks, with
``stage_boundary`` marks after the layers of each cut set, beside the one-device step and
each cut set's stages' work (its stages' F and B programs alone on one device, times m):
the total work is the same for every cut set, so a step that grows with the largest
stage's size is the lowering's padding (docs/results/pipeline.md, "One stage with the
heavy layers").
"""
import argparse
import os
from dataclasses import replace
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardprop as sp
from shardprop.compiler.pipeline_host import (HostFigures, RanksAtOnce, branch_programs, fit_capacity, rank_devices,
                                              stage_programs)
from shardprop.compiler.pipeline_step import core_share, host_step, measured_host_step, mpmd_host_step, shared_cores
from shardprop.passes.cost import CostModel
from shardprop.passes.pipeline import simulate
from shardprop.runtime.distributed import use_cpu_devices
from shardprop.runtime.pipeline_lower import bubble_computes_nothing, noop_branch_opcodes

DEVICES = 8


def force_cpu_devices(n: int = DEVICES) -> None:
    """Run on ``n`` forced CPU devices: called by ``main`` before jax starts its backend,
    so that importing this module (its model, ``make``) changes nothing."""
    use_cpu_devices(n)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def make(width, layers, batch, stages):
    opt = optax.adam(1e-3)
    per = layers // stages

    def loss_fn(params, x, y):
        h = x
        for i, w in enumerate(params):
            h = jnp.tanh(h @ w)
            if (i + 1) % per == 0 and i + 1 < layers:
                h = sp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        up, state = opt.update(g, state, params)
        return optax.apply_updates(params, up), state, loss

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, width)).astype(np.float32)
    return step, params, opt.init(params), x, y


class Stepper:
    """One training step per call, fed its own outputs (a pipelined step reads its
    packed state in place, as in training)."""

    def __init__(self, fn, params, state, x, y):
        self.fn, self.args = fn, (params, state, x, y)

    def __call__(self):
        p, s, loss = self.fn(*self.args)
        self.args = (p, s) + self.args[2:]
        jax.block_until_ready(loss)
        jax.block_until_ready([getattr(leaf, "buffer", leaf) for leaf in jax.tree.leaves(p)])


def interleaved(fns: dict, reps: int, cores=None) -> dict:
    """Median seconds per callable, timed round-robin ``reps`` times after one warm-up;
    into ``cores`` (a dict, where given) the cores each kept busy: this process's CPU
    seconds over its wall seconds, summed over the repetitions."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    cpu = dict.fromkeys(fns, 0.0)
    for _ in range(reps):
        for k, f in fns.items():
            c, t = time.process_time(), time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
            cpu[k] += time.process_time() - c
    if cores is not None:
        cores.update({k: cpu[k] / max(sum(times[k]), 1e-12) for k in fns})
    return {k: statistics.median(v) for k, v in times.items()}


class Together:
    """Each model stage's ``kind`` program on its own rank's device, all dispatched from
    one thread ``m`` rounds in a row (as the MPMD driver issues them), then waited for:
    the ranks' programs of one kind at once, against the same programs alone."""

    def __init__(self, prog, programs, kind, m):
        self.m = m
        self.programs = [programs[(kind, k)] for k in range(prog.S)]

    def __call__(self):
        for _ in range(self.m):
            for pr in self.programs:
                pr.dispatch()
        for pr in self.programs:
            pr.wait()


def pipelined(width, layers, batch, p, m, name, v=1, lowering="spmd"):
    step, params, state, x, y = make(width, layers, batch, p * v)
    pstep = sp.parallelize(step, mesh=((p,), ("pp",)), batch_argnums=(2, 3),
                           pipeline=sp.Pipeline(microbatches=m, schedule=name, virtual_stages=v, lowering=lowering))
    return pstep, (params, state, x, y)


def ablations(a, fns):
    """Where the gap goes (``--breakdown``), each variant of the 1F1B step timed beside
    the others: the lowering's three overhead fixes undone, the exchanges removed (wrong
    results, timing only), and the same programs on a model too small to compute anything
    (width 16) at m and 4m micro-batches, whose difference is the cost of a tick."""
    from jax import lax

    from shardprop.runtime import pipeline_lower
    p, m = a.pp, a.microbatches
    out = {}

    def build(label, width=a.width, mm=m, patch=None, tables=None):
        if a.only and label != "as built" and not any(o in label for o in a.only):
            return
        pstep, args = pipelined(width, a.layers, a.batch, p, mm, "1f1b")
        saved = {}
        for (obj, attr), val in (patch or {}).items():
            saved[(obj, attr)] = getattr(obj, attr)
            setattr(obj, attr, val)
        try:
            c, _, _ = pstep._compile(args)
            for key, val in (tables or {}).items():
                c.prog.tables[key] = np.full_like(c.prog.tables[key], val)
            stepper = Stepper(pstep, *args)
            stepper()                      # builds and compiles under the patch
        finally:
            for (obj, attr), val in saved.items():
                setattr(obj, attr, val)
        fns[("ablation", label)] = stepper
        out[label] = c.prog.T

    build("as built")
    build("transposes after the loop (undo 1)", patch={(pipeline_lower.PipelineProgram, "_plan_sunk"): lambda self: {}})
    build("every tick exchanges (undo 2)", tables={"any_f": 1, "any_b": 1})

    def no_hoist(self):
        self.hoist, self.hoist_sig = [{} for _ in range(self.p)], []
    build("weights sliced at every action (undo 3)", patch={(pipeline_lower.PipelineProgram, "_plan_hoist"): no_hoist})
    build("no exchanges (timing only)", patch={(lax, "ppermute"): lambda x, axis, perm: x})
    build("width 16, m", width=16)
    build("width 16, 4m", width=16, mm=4 * m)
    build("width 16, 4m, no exchanges", width=16, mm=4 * m, patch={(lax, "ppermute"): lambda x, axis, perm: x})
    build("width 16, m, no exchanges", width=16, patch={(lax, "ppermute"): lambda x, axis, perm: x})
    return out


class Branch:
    """One action of the tick loop as the lowering builds it (``_branch``: the stage's
    program plus unpacking its inputs from the packed state row, slot rows and batch,
    and packing what it sends, keeps and accumulates), jitted alone on one device and
    run ``times`` times a call, on zeros."""

    def __init__(self, prog, key, rep, batch, times):
        run = prog._branch(key)
        rows = tuple(jnp.zeros((n,), jnp.float32) for n in (prog.A, prog.R, prog.G, prog.O))
        state_row = jnp.zeros((prog.state_size,), jnp.float32)
        hoisted = jax.jit(lambda s: prog.unpack_hoisted(s, prog.rank_of(key[1])))(state_row)
        self.args = (rows, state_row, rep, batch, hoisted)
        accumulates = bool(prog.progs[key]["accs"])

        def one(rows, state_row, rep, batch, hoisted):
            out = run((rows, jnp.int32(0), state_row, rep, batch, hoisted))
            # what the loop keeps of it: the accumulator piece only where it accumulates
            return out if accumulates else (out[0], out[2], out[3])
        self.fn = jax.jit(one)
        self.times = times

    def __call__(self):
        for _ in range(self.times):
            out = self.fn(*self.args)
        jax.block_until_ready(out)


class AccumulatorAdd:
    """The tick loop's accumulation alone: a backward action's flat gradient piece added
    into the accumulator (in place: the accumulator is donated), ``times`` times a call."""

    def __init__(self, prog, times):
        from jax import lax
        n = prog.ACCK
        self.acc = jnp.zeros((prog.ACC,), jnp.float32)
        self.piece = jnp.ones((n,), jnp.float32)
        self.fn = jax.jit(lambda acc, piece: lax.dynamic_update_slice_in_dim(
            acc, lax.dynamic_slice_in_dim(acc, 0, n) + piece, 0, 0), donate_argnums=0)
        self.times = times

    def __call__(self):
        for _ in range(self.times):
            self.acc = self.fn(self.acc, self.piece)
        jax.block_until_ready(self.acc)


def branches(a, fns):
    """The 1F1B step's tick-loop branches, each alone, and its accumulations (``--breakdown``)."""
    pstep, args = pipelined(a.width, a.layers, a.batch, a.pp, a.microbatches, "1f1b")
    c, leaves, _ = pstep._compile(args)
    _, _, rep, batch = pstep._inputs(c, leaves)
    for key in c.prog.branch_keys[1:]:
        fns[("branch", key)] = Branch(c.prog, key, rep, batch, a.microbatches)
    accumulating = sum(1 for key in c.prog.branch_keys[1:] if c.prog.progs[key]["accs"]) * a.microbatches
    fns[("accumulate",)] = AccumulatorAdd(c.prog, accumulating)
    return c.prog


def threading(fns, width, batch, p):
    """One matmul program on one device, and the same program on ``p`` devices at once:
    one shard_map (as the SPMD lowering runs), and ``p`` programs each dispatched to its
    own device (as the MPMD driver runs them): whether the forced devices run side by side
    on this machine, either way."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    w = jnp.ones((width, width), jnp.float32)
    x = jnp.ones((batch, width), jnp.float32)
    one = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w)
    mesh = jax.make_mesh((p,), ("pp",), devices=jax.devices()[:p])
    many = jax.jit(jax.shard_map(lambda x, w: jnp.tanh(x[0] @ w[0]) @ w[0], mesh=mesh,
                                 in_specs=(P("pp"), P("pp")), out_specs=P("pp")))
    xs = jax.device_put(jnp.stack([x] * p), NamedSharding(mesh, P("pp")))
    ws = jax.device_put(jnp.stack([w] * p), NamedSharding(mesh, P("pp")))
    own = [(jax.device_put(x, d), jax.device_put(w, d)) for d in jax.devices()[:p]]
    fns[("threads", 1)] = lambda: jax.block_until_ready(one(x, w))
    fns[("threads", p)] = lambda: jax.block_until_ready(many(xs, ws))
    fns[("threads", "separate", p)] = lambda: jax.block_until_ready([one(*a) for a in own])


def in_run_figures(prog, wkey, med, plan_figures, reps, label):
    """``HostFigures`` from this run's timings (each stage program alone, the ``p`` ranks
    at once, in the same turns as the steps), the driver's costs as the plan measured
    them: the same model fed what the run itself measured, to tell a miss of the model's
    structure from a miss of its figures."""
    m = prog.m
    # the SPMD lowering's actions as its tick loop runs them (its branches), the MPMD's its programs
    spmd = ("idle loop", label) in med
    act = (lambda key: med[("branch", label, key)]) if spmd else (lambda key: med[("work", wkey, key)])
    alone = tuple(((kind, k), act((kind, k)) / m) for k in range(prog.S) for kind in prog.kinds)
    once = tuple(sum(med[("work", wkey, ("once", k))] for k in range(prog.S) if prog.rank_of(k) == d)
                 for d in range(prog.p))
    rank_work = tuple(sum(act((kind, k)) for k in range(prog.S) if prog.rank_of(k) == d
                          for kind in prog.kinds) for d in range(prog.p))
    together = med[("branches at once", label)] if spmd else med[("ranks at once", wkey)]
    runs = ((prog.p, rank_work, together),) if prog.p > 1 else ()
    in_loop = tuple(med[("rank loop", label, d)] for d in range(prog.p)) if spmd else ()
    return HostFigures(alone, once, fit_capacity(runs), runs, plan_figures.dispatch_s, plan_figures.transfer_s, reps,
                       med.get(("idle loop", label)), in_loop)


def criterion_4(runs, med, used, cost, p, m, reps) -> list:
    """Criterion 4's lines: per row the step against the plan's host model on its own
    stage programs' figures (``plan(measure=True)``, measured as the plan was made), with
    its parts beside what this run measured of the same figures, and the profile's host
    model for comparison."""
    lines = []
    if not runs:
        return lines
    mesh = next(iter(runs.values()))["plan"].program.mesh
    lines.append(f"4. step time / the cost model's (target: 0.80 to 1.20). The model: the plan's host_step_time "
                 f"with plan(measure=True) (compiler/pipeline_host.py): each stage action's program timed alone on "
                 f"its rank's device and the first n ranks' programs at once (n = 2..{p}), as the plan is made, "
                 f"then the same simulation as the profile's host model on those figures (SPMD: the tick loop in "
                 f"lockstep; MPMD: the driver's release times at its measured dispatch and transfer costs). Beside "
                 f"it: the parts as this run measured them (work alone, {p} ranks at once, in the same turns as the "
                 f"steps) and the model fed those; and {cost.name}'s host model (core_share: the profile's alone "
                 f"rates and at_once curve)")
    shown = set()
    for name, r in runs.items():
        prog, wkey = r["prog"], r["wkey"]
        if wkey in shown:
            continue
        shown.add(wkey)
        for kind in prog.kinds:
            alone = [med[("work", wkey, (kind, k))] for k in range(prog.S)]
            at_once = sum(alone) / med[("together", wkey, kind)]
            uses = [used[("work", wkey, (kind, k))] for k in range(prog.S)]
            lines.append(f"   {kind:<8} programs (S={prog.S}) in this run: cores each keeps busy alone (CPU / wall s) "
                         f"{' '.join(f'{u:.2f}' for u in uses)}; all {prog.S} at once (dispatched from one thread) "
                         f"did {at_once:.2f} ranks' work alone ({used[('together', wkey, kind)]:.2f} cores busy)")
    for name, r in runs.items():
        prog, figs, t = r["prog"], r["plan"].pipeline.host_figures, med[name]
        model = r["plan"].pipeline.host_step_time
        here = in_run_figures(prog, r["wkey"], med, figs, reps, name)
        model_here = measured_host_step(prog, here, r["low"], cost)[0]
        work_plan = sum(figs.once) + m * sum(s for _, s in figs.alone)
        work_here = sum(here.once) + m * sum(s for _, s in here.alone)
        share = core_share(mesh, p, cost, prog)
        profile_model = (mpmd_host_step if r["low"] == "mpmd" else host_step)(prog, cost, share)[0]
        lines.append(f"   {name:<17} step {t * 1e3:7.1f} ms, modeled {model * 1e3:7.1f} ms: {t / model:5.2f}   "
                     f"[{cost.name}'s host model {profile_model * 1e3:.1f} ms: {t / profile_model:.2f}]")
        extra = ""
        if r["low"] == "spmd":
            # what lockstep adds: the same figures run event by event, as the MPMD lowering runs
            sim = simulate(prog.schedule, figs.loop_durations(prog), cores=figs.capacity())
            events = float(sim.makespan) + figs.idle_loop
            fp, fh = figs.in_loop_factor(prog), here.in_loop_factor(prog)
            extra = (f"; the plan's figures without lockstep (event by event) {events * 1e3:.1f} ms; the program "
                     f"with no action at any tick, plan / this run: {figs.idle_loop * 1e3:.1f} / "
                     f"{here.idle_loop * 1e3:.1f} ms; each rank's actions in the loop over its branches alone, plan "
                     f"{' '.join(f'{x:.2f}' for x in fp)} / this run {' '.join(f'{x:.2f}' for x in fh)}")
        lines.append(f"   {'':<17} parts, plan (measured {r['plan_seconds']:.1f} s to make, load {r['plan_load']:.1f}) / "
                     f"this run: work alone (F+B x m + once) {work_plan * 1e3:.1f} / {work_here * 1e3:.1f} ms; "
                     f"{p} ranks at once did {figs.capacity()(p):.2f} / {here.capacity()(p):.2f} ranks' work; "
                     f"modeled step on this run's figures {model_here * 1e3:.1f} ms (step / that "
                     f"{t / model_here:.2f}){extra}")
        # which concurrency figure predicts: this run's work alone sharing the plan's curve, or
        # the calibration's (the profile's at_once, per rank: shared_cores), against this run's
        by = {}
        for label, curve in (("the plan's", figs.at_once), ("the calibration's", calibrated_curve(mesh, p, cost))):
            if curve is not None:
                by[label] = measured_host_step(prog, replace(here, at_once=curve), r["low"], cost)[0]
        lines.append(f"   {'':<17} plan's curve: " + ", ".join(f"{n} -> {c:.2f}" for n, c in figs.at_once)
                     + f"; driver {figs.dispatch_s * 1e6:.1f} us a program, {figs.transfer_s * 1e6:.1f} us a move; "
                     f"this run's work alone sharing " + ", ".join(f"{k} curve {v * 1e3:.1f} ms ({t / v:.2f})"
                                                                   for k, v in by.items()))
    return lines


def calibrated_curve(mesh, p, cost):
    """The profile's ``at_once`` curve as ranks' work done with 1..p ranks running
    (``shared_cores``; side by side where it shares nothing), or None without one."""
    if not cost.at_once:
        return None
    cap = shared_cores(mesh, p, cost)
    return tuple((n, float(cap(n)) if cap is not None else float(n)) for n in range(1, p + 1))


def add_model_args(ap) -> None:
    """The bench's model and pipeline (bench/pipeline_mpmd_processes.py takes them too)."""
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b"])
    ap.add_argument("--lowerings", nargs="+", default=["spmd", "mpmd"], choices=["spmd", "mpmd"],
                    help='Pipeline(lowering=...): the one SPMD program, the per-stage programs (MPMD), or both side '
                         'by side')
    ap.add_argument("--cost-model", default="cpu", help='built-in profile ("cpu", "h100") or a profile JSON path')
    ap.add_argument("--breakdown", action="store_true", help="also time the ablations of the gap (slower)")
    ap.add_argument("--only", nargs="+", help="with --breakdown: only the ablations whose label holds one of these "
                    "(e.g. 'undo 3'), beside the step as built, without the threading and branch timings")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--heavy-cuts", nargs="+", metavar="CUTS",
                    help="time bench/pipeline_cuts.py's light/heavy MLP at these cut sets (e.g. 1,3,5) instead")
    a = ap.parse_args(argv)
    force_cpu_devices()
    if a.heavy_cuts:
        return heavy_cuts(a)
    cost = CostModel.builtin(a.cost_model) if not a.cost_model.endswith(".json") else CostModel.load(a.cost_model)
    p, m = a.pp, a.microbatches
    lines = [f"pipeline bench: MLP width {a.width}, {a.layers} layers, batch {a.batch}, pp={p}, m={m}, "
             f"Adam; medians of {a.reps} interleaved repetitions; {os.cpu_count()} cores; jax {jax.__version__}; "
             f"cost model {cost.name}"]
    fns, runs, works = {}, {}, {}
    step, params, state, x, y = make(a.width, a.layers, a.batch, 1)
    fns["one device"] = Stepper(jax.jit(step), params, state, x, y)
    for name in a.schedules:
        v = 2 if name == "interleaved" else 1
        if a.layers % (p * v):
            lines.append(f"{name}: skipped, {a.layers} layers do not split into {p * v} model stages")
            continue
        for low in a.lowerings:
            pstep, args = pipelined(a.width, a.layers, a.batch, p, m, name, v, lowering=low)
            # criterion 4's model: the plan's host step on its stage programs' figures, measured
            # as the plan is made (before, and apart from, this run's timings)
            t0 = time.perf_counter()
            plan = pstep.plan(*args, measure=True)
            plan_seconds = time.perf_counter() - t0
            prog = plan.program
            # the stages' programs: the same for schedules with the same stages and action kinds
            wkey = (prog.S, tuple(prog.kinds))
            if wkey not in works:
                works[wkey] = stage_programs(prog, rank_devices(prog), m)
                for key, pr in works[wkey].items():
                    fns[("work", wkey, key)] = pr
                for kind in prog.kinds:     # the ranks' programs of a kind at once (criterion 4)
                    fns[("together", wkey, kind)] = Together(prog, works[wkey], kind, m)
                fns[("ranks at once", wkey)] = RanksAtOnce(prog, works[wkey], prog.p)
            label = name if low == "spmd" else f"{name} mpmd"
            if low == "spmd":
                compiled = pstep.compiled(*args)
                runs[label] = dict(plan=plan, prog=prog, wkey=wkey, hlo=compiled.as_text(),
                                   temp=compiled.memory_analysis().temp_size_in_bytes)
                fns[("idle loop", label)] = pstep.idle_loop(*args)
                for d in range(prog.p):
                    fns[("rank loop", label, d)] = pstep.idle_loop(*args, acting=(d,))
                c, leaves, _ = pstep._compile(args)
                _, _, rep_in, batch_in = pstep._inputs(c, leaves)
                branches_ = branch_programs(prog, rank_devices(prog), rep_in, batch_in)
                for kind in prog.kinds:
                    for k in range(prog.S):
                        fns[("branch", label, (kind, k))] = branches_[(kind, k)]
                fns[("branches at once", label)] = RanksAtOnce(prog, branches_, prog.p)
            else:
                runs[label] = dict(plan=plan, prog=prog, wkey=wkey, mpmd=pstep.mpmd(*args))
            runs[label].update(low=low, plan_seconds=plan_seconds, plan_load=os.getloadavg()[0])
            fns[label] = Stepper(pstep, *args)
    ticks = ablations(a, fns) if a.breakdown else {}
    # how many devices make progress at once here (criterion 4's second model)
    threading(fns, a.width, a.batch, p)
    if a.breakdown and not a.only:
        bprog = branches(a, fns)
    load = os.getloadavg()[0]
    used = {}
    med = interleaved(fns, a.reps, used)
    t1 = med["one device"]
    lines.append(f"load average (1 min) {load:.1f} before the timings, {os.getloadavg()[0]:.1f} after; "
                 f"one-device step: {t1 * 1e3:.1f} ms")

    lines.append("")
    lines.append("1. work on bubble ticks (target: none; the no-op branch of the compiled tick loop only moves buffers)")
    for name, r in runs.items():
        if "mpmd" in r:
            mp = r["mpmd"]
            actions = mp.actions_dispatched
            table = len(r["prog"].sim.tick_table)
            lines.append(f"   {name:<17} programs on bubbles: {'none' if actions == table else 'some'}   (the "
                         f"driver dispatches {actions} stage programs for the tick table's {table} actions)")
            continue
        ops = sorted(set(noop_branch_opcodes(r["hlo"])))
        lines.append(f"   {name:<17} computes nothing: {bubble_computes_nothing(r['hlo'])}   (no-op branch: "
                     f"{', '.join(ops)})")

    lines.append("")
    lines.append("2. step time / the stages' work (target: <= 1.10); the stages' work: each stage's F and B programs "
                 "run m times alone on one device, plus its once ops")
    for name, r in runs.items():
        prog, t = r["prog"], med[name]
        fb = sum(med[("work", r["wkey"], (kind, k))] for k in range(prog.S) for kind in prog.kinds)
        once = sum(med[("work", r["wkey"], ("once", k))] for k in range(prog.S))
        r["work"] = fb + once
        lines.append(f"   {name:<17} step {t * 1e3:7.1f} ms, stages' work {r['work'] * 1e3:7.1f} ms (F+B x m "
                     f"{fb * 1e3:.1f} + once {once * 1e3:.1f}): {t / r['work']:5.2f}   [no-pipeline step "
                     f"{t1 * 1e3:.1f} ms: step / no-pipeline {t / t1:.2f}, stages' work / no-pipeline "
                     f"{r['work'] / t1:.2f}]")
    for name in runs:
        if f"{name} mpmd" in runs:
            lines.append(f"   {name:<17} mpmd step / spmd step: {med[name + ' mpmd'] / med[name]:.2f}")
    # CPU seconds (this process's, over each call's wall time): what a step burns beyond its
    # stage programs alone is the driver's, the exchanges' and the waits'
    for name, r in runs.items():
        prog, wkey = r["prog"], r["wkey"]
        work_cpu = sum(used[("work", wkey, key)] * med[("work", wkey, key)] for key in works[wkey])
        step_cpu = used[name] * med[name]
        lines.append(f"   {name:<17} CPU seconds: step {step_cpu * 1e3:.1f} ms ({used[name]:.2f} cores busy), stages' "
                     f"work {work_cpu * 1e3:.1f} ms: {step_cpu / work_cpu:.2f}")

    lines.append("")
    lines.append("3. compiled memory (target: 1F1B's peak below GPipe's, its activations near p/m of GPipe's)")
    for name, r in runs.items():
        if "mpmd" in r:
            # no compiled tick loop: what the driver holds (sent, received, kept) at once per rank
            peak = r["mpmd"].peak_activation_bytes
            r["act"] = max(peak)
            lines.append(f"   {name:<17} activations the driver holds at once, per rank: "
                         f"{', '.join(f'{b / 2**20:.2f}' for b in peak)} MiB")
            continue
        prog = r["prog"]
        r["act"] = prog.nslots * (prog.A + prog.R + prog.G) * 4
        lines.append(f"   {name:<12} compiled temp {r['temp'] / 2**20:7.2f} MiB; activation slots {prog.nslots} x "
                     f"{(prog.A + prog.R + prog.G) * 4 / 2**10:.0f} KiB = {r['act'] / 2**20:.2f} MiB")
    if "gpipe" in runs and "1f1b" in runs:
        g, o = runs["gpipe"], runs["1f1b"]
        lines.append(f"   1f1b / gpipe: compiled peak {o['temp'] / g['temp']:.2f} (target < 1), activations "
                     f"{o['act'] / g['act']:.2f} (target p/m = {p / m:.2f})")
    if "gpipe mpmd" in runs and "1f1b mpmd" in runs:
        g, o = runs["gpipe mpmd"], runs["1f1b mpmd"]
        lines.append(f"   1f1b / gpipe (mpmd, the busiest rank's activations held): {o['act'] / g['act']:.2f}")

    lines.append("")
    lines += criterion_4(runs, med, used, cost, p, m, a.reps)

    if a.breakdown:
        lines.append("")
        lines.append("where the gap goes (1f1b; each line timed beside the others):")
        base = med[("ablation", "as built")]
        for label in ticks:
            t = med[("ablation", label)]
            lines.append(f"   {label:<40} {t * 1e3:8.2f} ms  ({t / base:5.2f} x as built; {ticks[label]} ticks)")
    if a.breakdown and not a.only:
        small = lambda lab: med[("ablation", lab)]
        dt = ticks["width 16, 4m"] - ticks["width 16, m"]
        per_tick = (small("width 16, 4m") - small("width 16, m")) / dt
        per_tick_local = (small("width 16, 4m, no exchanges") - small("width 16, m, no exchanges")) / dt
        lines.append(f"   a tick's cost (width 16, from m to 4m micro-batches): {per_tick * 1e6:.0f} us, of which "
                     f"{(per_tick - per_tick_local) * 1e6:.0f} us the exchanges and {per_tick_local * 1e6:.0f} us "
                     "the scan, switch and slot updates")
        if "1f1b" in runs:
            r = runs["1f1b"]
            alone = sum(med[("branch", key)] for key in bprog.branch_keys[1:])
            fb = sum(med[("work", r["wkey"], (kind, k))] for k in range(bprog.S) for kind in bprog.kinds)
            lines.append(f"   1f1b's tick-loop branches alone, m times each (the stage programs with their unpacking "
                         f"from the packed state row and slots, and packing of sends, kept values and gradients): "
                         f"{alone * 1e3:.1f} ms, against {fb * 1e3:.1f} ms for the stage programs alone "
                         f"({alone / fb:.2f} x) and {med['1f1b'] * 1e3:.1f} ms for the step ({med['1f1b'] / alone:.2f} x)")
            nacc = sum(1 for key in bprog.branch_keys[1:] if bprog.progs[key]["accs"]) * m
            lines.append(f"   its accumulations alone ({nacc} adds of a {bprog.ACCK * 4 / 2**20:.1f} MiB gradient piece "
                         f"into the accumulator, in place): {med[('accumulate',)] * 1e3:.1f} ms, "
                         f"{med[('accumulate',)] / med['1f1b']:.2f} of the step")
        lines.append(f"   threading: a matmul program on one device {med[('threads', 1)] * 1e3:.2f} ms, the same on "
                     f"{p} devices at once {med[('threads', p)] * 1e3:.2f} ms ({med[('threads', p)] / med[('threads', 1)]:.2f}"
                     f" x: 1.00 x would be side by side, {p:.2f} x taking turns)")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


def heavy_cuts(a):
    """``--heavy-cuts``: the light/heavy MLP at each cut set, 1F1B, interleaved with the
    one-device step; and each cut set's stages' work (``pipeline_cuts.stage_work``)."""
    import types
    import pipeline_cuts as pc
    shape = dict(width=256, light=6, heavy=2, ratio=8, batch=128)
    m = a.microbatches
    cut_sets = [tuple(int(c) for c in s.split(",")) for s in a.heavy_cuts]
    fns = {}
    for cuts in cut_sets:
        step, params, state, x, y = pc.make(cut_after=cuts, **shape)
        for low in a.lowerings:
            pstep = sp.parallelize(step, mesh=((a.pp,), ("pp",)), batch_argnums=(2, 3),
                                   pipeline=sp.Pipeline(microbatches=m, schedule="1f1b", lowering=low))
            fns[(cuts, low)] = Stepper(pstep, params, state, x, y)
    fns["one device"] = Stepper(jax.jit(step), params, state, x, y)
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for rep in range(a.reps):
        for k in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    bounds = {c: [b - a_ for a_, b in zip((-1,) + c, c + (shape["light"] + shape["heavy"] - 1,))] for c in cut_sets}
    names = {f"cuts {c}": bounds[c] for c in cut_sets}
    # stage_work interleaves two sets of stages, named "auto" and "equal": pairs of cut sets
    work = {}
    keys = list(names)
    for i in range(0, len(keys), 2):
        pair = keys[i:i + 2] if i + 1 < len(keys) else [keys[i], keys[0]]
        w = pc.stage_work(types.SimpleNamespace(reps=a.reps, steps=5, **shape),
                          {"auto": names[pair[0]], "equal": names[pair[1]]}, shape["batch"] // m)
        work[pair[0]], work[pair[1]] = w["auto"], w["equal"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"light/heavy MLP (bench/pipeline_cuts.py: 6 light + 2 heavy layers x8, width 256, batch 128), pp={a.pp}, "
          f"m={m}, 1f1b; medians of {a.reps} interleaved repetitions; load {os.getloadavg()[0]:.1f}")
    print(f"   one-device step {med['one device'] * 1e3:.1f} ms")
    for c in cut_sets:
        per = work[f"cuts {c}"]
        total = m * sum(f + b for f, b in per)
        for low in a.lowerings:
            t = med[(c, low)]
            print(f"   cuts after {c}, {low}: layers per stage {bounds[c]}, step {t * 1e3:.1f} ms "
                  f"{sorted(round(x * 1e3) for x in times[(c, low)])}; stages' work (F+B x m) {total * 1e3:.1f} ms "
                  f"(per stage {[round(m * (f + b) * 1e3, 1) for f, b in per]}): step / work {t / total:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
