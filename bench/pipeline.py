"""Pipeline parallelism on 8 forced CPU devices: issue 26's four criteria, measured.

An MLP training step (Adam) with a ``stage_boundary`` after every ``layers / (pp*v)``
layers, run on one device and pipelined on ``pp`` ranks. The forced CPU devices share
this machine's cores, so a rank that idles frees a core for the others: wall-clock idle
time is not the bubble. What the CPU can show, each figure next to its target:

1. **work on bubble ticks**: the no-op branch of the compiled tick loop only moves
   buffers (``runtime/pipeline_lower.py`` ``bubble_computes_nothing``), per schedule;
2. **step time against the sum of the stages' work**: the pipelined step against
   ``m`` times each stage's forward and backward programs plus its once ops (the
   optimizer), each program jitted alone on one device of this process, its own
   equations only (no packing, no exchange). Same process, same XLA CPU threading as the
   one-device step of the same model, which is printed beside it (on this machine a
   jitted program runs on one thread whether or not other devices are busy: see
   docs/results/pipeline.md). Target: at most 1.10;
3. **1F1B's compiled peak below GPipe's**, activations near ``p/m`` of GPipe's: the
   compiled programs' temp bytes (``memory_analysis()``) and the activation slot buffers
   (slots x the stage input, the kept forward values and the cotangent);
4. **step time against the cost model's**: the model of what runs here, the plan's
   ``host_step_time`` (``compiler/pipeline_step.py``): each stage's programs priced by
   the cost model given (default the calibrated ``"cpu"`` profile) at one device's rate
   alone (``alone_cost``: the rates ``shardprop calibrate`` measured on one device alone,
   or for a profile without them the rates over the contention derived from its devices
   and the host's cores), the ranks sharing what the host runs at once (``core_share``:
   each action's cores alone, from the profile's measured ``cores_alone``, against its
   ``at_once`` curve; without ``cores_alone``, ``shared_cores``: the curve counting ranks,
   or the host's cores; the counting model is printed beside it). For the SPMD
   lowering (``host_step``) the tick table simulated so, then the ranks' once ops sharing
   the cores too; for the MPMD lowering (``mpmd_host_step``) the same with each action
   released when the Python driver has issued it (the profile's ``dispatch_s`` per
   program, ``transfer_s`` per value moved), each rank's once ops starting when its
   actions are done. Target: within 20%. Beside it, the side-by-side model at the
   profile's contended rates (the plan's ``step_time`` plus the slowest rank's once ops),
   and the shared-cores simulation fed the measured stage programs instead of the cost
   model. A profile from ``shardprop calibrate`` on the host that runs the bench is the
   one to pass (``--cost-model profile.json``). Above the rows: per action kind, the
   cores each stage program keeps busy alone (CPU over wall seconds) measured and
   modeled, and the ranks' programs of that kind run at once (``Together``) against
   them alone, beside what the two models predict.

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
from jax.extend import core as jcore

import shardprop as sp
from shardprop.compiler.calibrate import host_cores
from shardprop.compiler.pipeline_step import (_eqn_time, _modeled_times, action_cores, alone_cost,
                                              calibration_contention, core_share, devices_at_once, host_step,
                                              mpmd_host_step, shared_cores, spmd_step, stage_durations)
from shardprop.passes.cost import CostModel
from shardprop.passes.pipeline.simulate import _capacity
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


class Program:
    """Equations ``idxs`` of the pipeline's micro-batch jaxpr, jitted alone on one device:
    inputs are what they read (zeros of the right shapes), outputs ``outs``. A call runs
    it ``times`` times back to back (a stage's ``m`` micro-batches), so that a sample is
    long enough to time on a loaded machine."""

    def __init__(self, prog, idxs, outs, times=1):
        self.times = times
        j = prog.j
        self.prog, self.idxs = prog, list(idxs)
        reads = [v for v in prog._reads(self.idxs) if v not in set(j.constvars)]
        produced = {o for i in self.idxs for o in j.eqns[i].outvars}
        self.outs = [v for v in dict.fromkeys(outs) if v in produced]
        self.reads = reads
        self.args = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in reads]

        def run(*vals):
            env = dict(zip(j.constvars, prog.consts))
            env.update(zip(reads, vals))
            prog._run(self.idxs, env)
            return [env[v] for v in self.outs]
        self.fn = jax.jit(run)

    def __call__(self):
        for _ in range(self.times):
            out = self.fn(*self.args)
        jax.block_until_ready(out)

    def modeled(self, cost) -> float:
        return sum(_eqn_time(self.prog.j.eqns[i], cost) for i in self.idxs)


def stage_programs(prog, m):
    """Per model stage: its forward and backward programs (what they send, keep for the
    backward, accumulate and output), each run ``m`` times a call, and its once ops (the
    new state), run once."""
    out = {}
    outvars = [v for v in prog.j.outvars if not isinstance(v, jcore.Literal)]
    for k in range(prog.S):
        for kind in prog.kinds:
            pr = prog.progs[(kind, k)]
            keep = list(prog.resid[k].vars) if kind == "forward" else []
            out[(kind, k)] = Program(prog, pr["idxs"], list(pr["sends"]) + pr["accs"] + pr["outs_b"] + keep, m)
        out[("once", k)] = Program(prog, prog.once[k]["idxs"], outvars)
    return out


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
    the ranks' programs at once, against the same programs alone (``Program``)."""

    def __init__(self, prog, programs, kind, m):
        devices = np.asarray(prog.mesh.devices).reshape(prog.p, -1)[:, 0]
        self.m = m
        self.calls = [(programs[(kind, k)].fn, [jax.device_put(x, devices[prog.rank_of(k)])
                                                  for x in programs[(kind, k)].args]) for k in range(prog.S)]

    def __call__(self):
        out = []
        for _ in range(self.m):
            out += [fn(*args) for fn, args in self.calls]
        jax.block_until_ready(out)


def modeled_step(prog, durations, latency, once, cores=None):
    """The SPMD step's model (``spmd_step``) with these stage times, in seconds."""
    return spmd_step(prog, durations, latency, once, cores)[0]


def cost_model_step(prog, cost, once_programs):
    """The plan's modeled step priced by ``cost`` (``_modeled_times``: each stage
    program's roofline, each boundary's exchange), plus the slowest rank's once ops."""
    times, latency = _modeled_times(prog, cost)
    durations = stage_durations(prog, times)
    once = [sum(once_programs[k].modeled(cost) for k in range(prog.S) if prog.rank_of(k) == d)
            for d in range(prog.p)]
    return modeled_step(prog, durations, latency, once), max(once)


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
            plan = pstep.plan(*args)
            prog = plan.program
            # the stages' programs: the same for schedules with the same stages and action kinds
            wkey = (prog.S, tuple(prog.kinds))
            if wkey not in works:
                works[wkey] = stage_programs(prog, m)
                for key, pr in works[wkey].items():
                    fns[("work", wkey, key)] = pr
                for kind in prog.kinds:     # the ranks' programs of a kind at once (criterion 4)
                    fns[("together", wkey, kind)] = Together(prog, works[wkey], kind, m)
            label = name if low == "spmd" else f"{name} mpmd"
            if low == "spmd":
                compiled = pstep.compiled(*args)
                runs[label] = dict(plan=plan, prog=prog, wkey=wkey, hlo=compiled.as_text(),
                                   temp=compiled.memory_analysis().temp_size_in_bytes)
            else:
                runs[label] = dict(plan=plan, prog=prog, wkey=wkey, mpmd=pstep.mpmd(*args))
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
    mesh = next(iter(runs.values()))["plan"].program.mesh if runs else None
    cores = shared_cores(mesh, p, cost) if mesh is not None else None
    # measured: p devices running one program at once take tp against t1 alone, so p * t1 / tp
    # of them progress at once (this process's share of the host's cores, under its load);
    # at least one, as a rank running alone is at its alone rate by definition
    together = min(p, max(1.0, p * med[("threads", 1)] / med[("threads", p)]))
    contention = calibration_contention(cost)
    at_once = devices_at_once(cost)
    curve = ", ".join(f"{k} busy -> {c:.2f}" for k, c in cost.at_once)
    how = (f"measured by its calibration: one device alone {contention:.2f} x as fast as with all "
           f"{cost.device_count} busy; devices' work done at once: {curve or f'{at_once:.2f} with all busy'}"
           if at_once is not None else
           f"derived, not measured: its {cost.device_count} devices on this host's {host_cores()} cores")
    driver = (f"; the MPMD driver's {cost.dispatch_s * 1e6:.1f} us per program dispatched and "
              f"{(cost.transfer_s or 0) * 1e6:.1f} us per value moved" if cost.dispatch_s is not None else
              "; no driver costs in the profile (MPMD dispatch priced at 0)")
    lines.append(f"4. step time / the cost model's (target: 0.80 to 1.20); model: {cost.name}'s stage times at one "
                 f"device's rate alone (contention {contention:.2f}, {how}), the tick table simulated with "
                 f"the {p} ranks sharing the host "
                 f"({'side by side' if cores is None else f'{float(_capacity(cores, p)):.2f} ranks of work done with all {p} running'}), then the once "
                 f"ops sharing it{driver}. Measured here: a matmul program on one device {med[('threads', 1)] * 1e3:.2f} "
                 f"ms, on {p} devices at once {med[('threads', p)] * 1e3:.2f} ms, so {p} devices progress as "
                 f"{together:.2f} alone (at least 1; as {p} programs each dispatched to its device, the MPMD "
                 f"driver's way, {med[('threads', 'separate', p)] * 1e3:.2f} ms, "
                 f"{p * med[('threads', 1)] / med[('threads', 'separate', p)]:.2f} alone); 'measured cores' is the same model with that in place of the "
                 f"{host_cores()} cores, in the sharing and in the calibration's contention ({cost.device_count} / "
                 f"{together:.2f}: as if calibrated under this run's load)")
    shown = set()
    for name, r in runs.items():
        prog, wkey = r["prog"], r["wkey"]
        if wkey in shown:
            continue
        shown.add(wkey)
        priced = action_cores(prog, cost)
        share = core_share(mesh, p, cost, prog)
        for kind in prog.kinds:
            alone = [med[("work", wkey, (kind, k))] for k in range(prog.S)]
            at_once = sum(alone) / med[("together", wkey, kind)]
            uses = [used[("work", wkey, (kind, k))] for k in range(prog.S)]
            model_uses = [priced[0][k][kind] for k in range(prog.S)] if priced else None
            predicted = (f"{prog.S * share.rate([u * len(np.asarray(mesh.devices).reshape(-1)) / p for u in model_uses]):.2f}"
                         if model_uses and hasattr(share, "rate") else "-")
            counted = f"{min(prog.S, float(_capacity(cores, prog.S))):.2f}" if cores is not None else f"{prog.S}"
            lines.append(f"   {kind:<8} programs (S={prog.S}): cores each keeps busy alone (CPU / wall s) "
                         f"{' '.join(f'{u:.2f}' for u in uses)} measured"
                         + (f", {' '.join(f'{u:.2f}' for u in model_uses)} modeled" if model_uses else "")
                         + f"; all {prog.S} ranks' at once (dispatched from one thread) did {at_once:.2f} ranks' "
                         f"work alone ({used[('together', wkey, kind)]:.2f} cores busy); modeled: {predicted} "
                         f"by their cores, {counted} counting ranks")
    for name, r in runs.items():
        prog, works_ = r["prog"], works[r["wkey"]]
        host_model = mpmd_host_step if "mpmd" in r else host_step
        share = core_share(mesh, p, cost, prog)
        model, _, _ = host_model(prog, cost, share)
        model_counted, _, _ = host_model(prog, cost, cores)
        model_here, _, _ = host_model(prog, cost, together,
                                      contention=max(1.0, (cost.device_count or 1) / together))
        # the model before calibrate measured the host: contention from devices over cores, the
        # host's cores shared, both lowerings priced as the SPMD one (host_step)
        derived = replace(cost, alone=None, dispatch_s=None, transfer_s=None, at_once=())
        model_derived, _, _ = host_step(prog, derived, shared_cores(mesh, p, derived))
        contended, _ = cost_model_step(prog, cost, {k: works_[("once", k)] for k in range(prog.S)})
        # the same simulation on the stage programs measured above (one device, alone)
        measured = {kind: [med[("work", r["wkey"], (kind, k))] / m for k in range(prog.S)] for kind in prog.kinds}
        once_meas = [sum(med[("work", r["wkey"], ("once", k))] for k in range(prog.S) if prog.rank_of(k) == d)
                     for d in range(p)]
        sim_meas = modeled_step(prog, measured, 0.0, once_meas, cores)
        sim_here = modeled_step(prog, measured, 0.0, once_meas, together)
        # the ranks' own programs at once (Together), F and B together: the work they got
        # done with all S running, as the sharing (what concurrency alone would explain)
        own = (sum(med[("work", r["wkey"], (kind, k))] for kind in prog.kinds for k in range(prog.S))
               / sum(med[("together", r["wkey"], kind)] for kind in prog.kinds))
        sim_own = modeled_step(prog, measured, 0.0, once_meas, min(float(p), own))
        modeled_fb = sum(works_[(kind, k)].modeled(cost) for k in range(prog.S) for kind in prog.kinds) * m
        alone_fb = sum(works_[(kind, k)].modeled(alone_cost(cost)) for k in range(prog.S) for kind in prog.kinds) * m
        meas_fb = sum(med[("work", r["wkey"], (kind, k))] for k in range(prog.S) for kind in prog.kinds)
        t = med[name]
        lines.append(f"   {name:<17} step {t * 1e3:7.1f} ms, modeled {model * 1e3:7.1f} ms: {t / model:5.2f}   "
                     f"[counting ranks, not their cores: modeled {model_counted * 1e3:.1f} ms, "
                     f"{t / model_counted:.2f}] "
                     f"[the model before: contention from devices / cores, MPMD as SPMD: modeled {model_derived * 1e3:.1f} "
                     f"ms, {t / model_derived:.2f}] "
                     f"[measured cores: modeled {model_here * 1e3:.1f} ms, {t / model_here:.2f}; side by side at the "
                     f"contended rates {contended * 1e3:.1f} ms, {t / contended:.2f}]")
        lines.append(f"   {'':<17} where it misses: {cost.name}'s F+B x m alone {alone_fb * 1e3:.1f} ms "
                     f"({modeled_fb * 1e3:.1f} contended) against {meas_fb * 1e3:.1f} measured alone; the shared-cores "
                     f"simulation on the measured stage programs {sim_meas * 1e3:.1f} ms (step / that "
                     f"{t / sim_meas:.2f}), on measured cores {sim_here * 1e3:.1f} ms ({t / sim_here:.2f}), on the stage "
                     f"programs' own work at once ({own:.2f} ranks') {sim_own * 1e3:.1f} ms ({t / sim_own:.2f})")

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
