"""Automatic stage cuts against equal-layer cuts on a model with deliberately unequal
layers (issue 26, "Search"): modeled and measured.

The model is an MLP training step (Adam) whose layers differ in width: ``--light`` light
layers (``tanh(h @ A) @ B`` through a hidden of ``width``) then ``--heavy`` heavy ones (a
hidden of ``width * --ratio``), so the heavy layers cost ``--ratio`` times the light ones.
It is pipelined on ``--pp`` ranks (``mesh=((pp,), ("pp",))``) twice, in the same process:

- **auto**: no ``stage_boundary`` marks, ``sp.Pipeline(microbatches=m, schedule=...)``:
  the pipelined step's own search chooses the cuts (``PipelineFunction._search_cuts``:
  ``passes/pipeline/search.py`` ``search_pipeline`` over the forward ops, priced by
  ``compiler/pipeline_assign.py`` ``layer_costs``; m and the schedule fixed here);
- **equal**: a ``stage_boundary`` after every ``layers / pp`` layers (the cuts a user
  writes by counting layers).

It prints, for each:

1. the stages the compiler built (layers per stage) and its modeled step
   (``plan().pipeline.step_time``: the simulator on the default cost model's stage times);
2. **measured stage work**: each stage's layers, forward and backward of one micro-batch,
   run as their own jitted program on one device (median of ``--reps`` interleaved
   repetitions), and the schedule's makespan with those measured durations
   (``passes/pipeline/simulate.py``): what the cuts decide, the balance, measured on this
   machine's compute;
3. the **measured pipelined step**: the median of ``--reps`` interleaved repetitions (auto,
   equal, equal, auto, ...) of the median of ``--steps`` steps;
4. **modeled on this machine's profile** (``CostModel.builtin("cpu")``): the configuration
   search (``passes/pipeline/search.py``, pp, m and schedule fixed) against equal-layer
   cuts (``equal_layer_candidate``), layers priced by their matmuls' roofline;
5. **the compiler's own plan on that profile**: both steps planned by
   ``sp.parallelize(..., cost_model="cpu")`` on ``((pp, 8 // pp), ("pp", "dp"))`` (the
   profile prices meshes of 8 devices), ``plan().pipeline.step_time`` side by side, and
   the auto step's joint search (``microbatches="auto", schedule="auto"``) for reference.

Forced CPU devices share this machine's cores, so a pipeline's ranks do not run in
parallel as GPUs would: a rank that idles frees a core for the others, and the measured
pipelined step (3) is bounded by the total work over the cores as much as by the slowest
stage. (2) is the figure that isolates the cuts, and the bench prints how many ranks' work
the host does at once (the ranks' devices given a heavy-width layer each together,
against one): near 1, as on the 2-vCPU machines this project is developed on, no cuts can show in
(3). On a host with a core per rank (``bench/gpu_session.sh`` runs it on a lent machine's
16 cores) they can.

    python bench/pipeline_cuts.py                       # pp 4, 6 light + 2 heavy layers (x8), m 8, 1f1b
    python bench/pipeline_cuts.py --reps 7 --steps 5
    python bench/pipeline_cuts.py --pp 2 --light 2 --heavy 2 --batch 512 --lowering mpmd --one-thread-per-device
"""
import argparse
import os
import statistics
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
if "--one-thread-per-device" in sys.argv:
    # each forced device runs its ops on its own thread only, as a GPU computes its own work:
    # without this, one rank's large matmul spreads over every core, and a pipeline's idle
    # ranks hide its imbalance (the step is bounded by the total work over the cores)
    os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardprop as sp  # noqa: E402
from shardprop.passes.pipeline import build_schedule, simulate  # noqa: E402


def make(width, light, heavy, ratio, batch, cut_after=()):
    """(step, params, opt_state, x, y): ``light`` layers of hidden ``width`` then ``heavy``
    of hidden ``width * ratio``; a stage_boundary after each layer index in ``cut_after``."""
    opt = optax.adam(1e-3)
    hidden = [width] * light + [width * ratio] * heavy

    def loss_fn(params, x, y):
        h = x
        for i, (a, b) in enumerate(params):
            h = h + jnp.tanh(h @ a) @ b
            if i in cut_after:
                h = sp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        up, state = opt.update(g, state, params)
        return optax.apply_updates(params, up), state, loss

    rng = np.random.default_rng(0)
    params = [((rng.standard_normal((width, k)) / np.sqrt(width)).astype(np.float32),
               (rng.standard_normal((k, width)) / np.sqrt(k) / 4).astype(np.float32)) for k in hidden]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, width)).astype(np.float32)
    return step, params, opt.init(params), x, y


def steps_median(fn, state, steps):
    p, s, x, y = state
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        p, s, loss = fn(p, s, x, y)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
    state[0], state[1] = p, s
    return statistics.median(times)


def stage_work(a, layers_per_stage, rows):
    """name -> [(forward s, backward s)] per stage: each stage's layers on one micro-batch,
    jitted on one device, medians of interleaved repetitions."""
    step, params, state, x, y = make(a.width, a.light, a.heavy, a.ratio, a.batch)
    h0 = x[:rows]
    fns = {}
    for name, counts in layers_per_stage.items():
        start, per = 0, []
        for k, n in enumerate(counts):
            ps = params[start:start + n]
            last = k == len(counts) - 1

            def fwd(ps, h, last=last):
                for a_, b_ in ps:
                    h = h + jnp.tanh(h @ a_) @ b_
                return jnp.mean((h - y[:rows]) ** 2) if last else h
            f = jax.jit(fwd)
            b = jax.jit(lambda ps, h, fwd=fwd: jax.vjp(fwd, ps, h)[1](jnp.ones_like(fwd(ps, h))))
            jax.block_until_ready(f(ps, h0))
            jax.block_until_ready(b(ps, h0))
            per.append((f, b, ps))
            start += n
        fns[name] = per
    times = {name: [([], []) for _ in per] for name, per in fns.items()}
    for rep in range(a.reps):
        for name in (("auto", "equal") if rep % 2 == 0 else ("equal", "auto")):
            for k, (f, b, ps) in enumerate(fns[name]):
                for fn, out in ((f, times[name][k][0]), (b, times[name][k][1])):
                    t = time.perf_counter()
                    for _ in range(a.steps):
                        jax.block_until_ready(fn(ps, h0))
                    out.append((time.perf_counter() - t) / a.steps)
    # the backward program runs the forward again (vjp): its own time is the difference
    out = {}
    for name, per in times.items():
        out[name] = [(statistics.median(fs), max(0.0, statistics.median(bs) - statistics.median(fs)))
                     for fs, bs in per]
    return out


def side_by_side(a, rows) -> float:
    """How many ranks' work this host does at once: ``bench/pipeline.py``'s ``threading``
    program (a layer of the heavy width) on one device, and on each of the ``pp`` ranks'
    devices dispatched together (as the MPMD driver does), medians of ``--reps``
    interleaved repetitions. Near 1, the ranks run one after another, and any cuts take
    the stages' total work: the measured ratio (3) cannot show the balance (2) decides."""
    from bench.pipeline import interleaved, threading
    fns = {}
    threading(fns, a.width * a.ratio, rows, a.pp)
    med = interleaved(fns, a.reps)
    return a.pp * med[("threads", 1)] / med[("threads", "separate", a.pp)]


def cpu_model(a, rows):
    """The search against equal-layer cuts, priced by this machine's built-in profile."""
    from shardprop.passes.cost import CostModel
    from shardprop.passes.pipeline.search import LayerCosts, equal_layer_candidate, search_pipeline
    cost = CostModel.builtin("cpu")
    hidden = [a.width] * a.light + [a.width * a.ratio] * a.heavy
    fwd = []
    for k in hidden:          # two matmuls and a tanh per layer, at micro-batch rows
        mm = 2 * 2.0 * rows * a.width * k
        touched = 4.0 * 2 * (rows * a.width + a.width * k + rows * k)
        fwd.append(cost.compute_time(mm, touched, contraction=True) + cost.compute_time(rows * k, 8.0 * rows * k))
    L = len(hidden)
    costs = LayerCosts(forward_s=fwd, backward_s=[2 * f for f in fwd], state_bytes=[0.0] * L,
                       activation_bytes=[0.0] * L, exchange_bytes=[4.0 * rows * a.width] * (L - 1), rows=rows)
    batch = rows * a.microbatches
    found = search_pipeline(costs, a.pp, batch, cost, pp=a.pp, tp=1, microbatches=a.microbatches,
                            schedules=(a.schedule,), axis_names=("pp", "dp", "mp")).best
    equal = equal_layer_candidate(costs, a.pp, batch, cost, pp=a.pp, tp=1, microbatches=a.microbatches,
                                  schedule=a.schedule)
    print(f"  modeled on the cpu profile: search cuts {found.cuts.bounds} {found.step_s * 1e3:.2f} ms, equal "
          f"cuts {equal.cuts.bounds} {equal.step_s * 1e3:.2f} ms: equal / search = "
          f"{equal.step_s / found.step_s:.2f}x")


def cpu_plans(a, equal_cuts):
    """(5): both steps planned on the calibrated cpu profile, on pp x dp over 8 devices."""
    mesh = ((a.pp, 8 // a.pp), ("pp", "dp"))
    got = {}
    for name, cuts, pl in (("auto", (), sp.Pipeline(microbatches=a.microbatches, schedule=a.schedule)),
                           ("equal", equal_cuts, sp.Pipeline(microbatches=a.microbatches, schedule=a.schedule)),
                           ("auto, m and schedule searched too", (), sp.Pipeline(microbatches="auto",
                                                                                 schedule="auto"))):
        step, params, state, x, y = make(a.width, a.light, a.heavy, a.ratio, a.batch, cuts)
        t = time.perf_counter()
        info = sp.parallelize(step, mesh=mesh, pipeline=pl, batch_argnums=(2, 3),
                              cost_model="cpu").plan(params, state, x, y).pipeline
        got[name] = info
        dots = [sum(1 for op in s.forward_ops if op == "dot_general") // 2 for s in info.stages]
        print(f"  cpu profile, {mesh}: {name:5}: layers per stage {dots}, m={info.microbatches} "
              f"{info.schedule_name}, modeled step {info.step_time * 1e3:.2f} ms (planned in "
              f"{time.perf_counter() - t:.1f} s)")
    print(f"  the compiler's modeled step on the cpu profile: equal / auto = "
          f"{got['equal'].step_time / got['auto'].step_time:.2f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--light", type=int, default=6)
    ap.add_argument("--heavy", type=int, default=2)
    ap.add_argument("--ratio", type=int, default=8, help="a heavy layer's hidden width over a light one's")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lowering", default="spmd", choices=("spmd", "mpmd"))
    ap.add_argument("--one-thread-per-device", action="store_true",
                    help="XLA's CPU ops single-threaded (--xla_cpu_multi_thread_eigen=false): a rank's work "
                         "stays on its own thread, as a GPU's does")
    a = ap.parse_args(argv)
    layers = a.light + a.heavy
    per = layers // a.pp
    equal_cuts = tuple(per * k - 1 for k in range(1, a.pp))
    mesh = ((a.pp,), ("pp",))
    pipeline = sp.Pipeline(microbatches=a.microbatches, schedule=a.schedule, lowering=a.lowering)
    runs = {}
    for name, cuts in (("auto", ()), ("equal", equal_cuts)):
        step, params, state, x, y = make(a.width, a.light, a.heavy, a.ratio, a.batch, cuts)
        pstep = sp.parallelize(step, mesh=mesh, pipeline=pipeline, batch_argnums=(2, 3))
        info = pstep.plan(params, state, x, y).pipeline
        fn = pstep
        st = [params, state, x, y]
        p, s, loss = fn(*st)                      # compile and warm up
        jax.block_until_ready(loss)
        st[0], st[1] = p, s
        runs[name] = dict(fn=fn, state=st, info=info, times=[])
    print(f"MLP, {a.light} light + {a.heavy} heavy layers (hidden {a.width} / {a.width * a.ratio}), batch {a.batch}, "
          f"pp={a.pp}, m={a.microbatches}, {a.schedule}, {a.lowering} lowering"
          f"{', one thread per device' if a.one_thread_per_device else ''}; equal cuts after layers {list(equal_cuts)}")
    for name, r in runs.items():
        info = r["info"]
        dots = [sum(1 for op in s.forward_ops if op == "dot_general") for s in info.stages]
        fwd = [round(t["forward"] * 1e6, 1) for t in info.stage_times]
        print(f"  {name:5}: forward matmuls per stage {dots}; modeled forward per stage (us) {fwd}; modeled step "
              f"{info.step_time * 1e6:.1f} us, bubble {info.bubble:.3f}")
    for rep in range(a.reps):                     # interleaved: auto, equal, equal, auto, ...
        order = ("auto", "equal") if rep % 2 == 0 else ("equal", "auto")
        for name in order:
            runs[name]["times"].append(steps_median(runs[name]["fn"], runs[name]["state"], a.steps))
    med = {n: statistics.median(r["times"]) for n, r in runs.items()}
    rows = a.batch // a.microbatches
    layers_per_stage = {}
    for name, r in runs.items():                  # two matmuls per layer
        dots = [sum(1 for op in s.forward_ops if op == "dot_general") // 2 for s in r["info"].stages]
        layers_per_stage[name] = dots
    work = stage_work(a, layers_per_stage, rows)
    composed = {}
    for name, per_stage in work.items():
        sched = build_schedule(a.schedule, a.pp, a.microbatches)
        durations = {"forward": [f for f, _ in per_stage], "backward": [b for _, b in per_stage]}
        composed[name] = float(simulate(sched, durations).makespan)
        print(f"  {name:5}: layers per stage {layers_per_stage[name]}; measured stage work per micro-batch (ms, "
              f"forward + backward) {[round((f + b) * 1e3, 2) for f, b in per_stage]}; schedule makespan with "
              f"them {composed[name] * 1e3:.1f} ms")
    print(f"  measured stage work, composed by the schedule: equal / auto = {composed['equal'] / composed['auto']:.2f}x")
    print(f"  this host runs the {a.pp} ranks' work at once as {side_by_side(a, rows):.2f} ranks' alone "
          f"(a heavy-width layer on each rank's device, dispatched together, against one)")
    cpu_model(a, rows)
    cpu_plans(a, equal_cuts)
    modeled = runs["equal"]["info"].step_time / runs["auto"]["info"].step_time
    print(f"  the compiler's modeled step on the default cost model: equal / auto = {modeled:.2f}x")
    print(f"  measured (median of {a.reps} interleaved repetitions of {a.steps} steps): auto {med['auto'] * 1e3:.1f} ms "
          f"{sorted(round(t * 1e3, 1) for t in runs['auto']['times'])}, equal {med['equal'] * 1e3:.1f} ms "
          f"{sorted(round(t * 1e3, 1) for t in runs['equal']['times'])}: equal / auto = "
          f"{med['equal'] / med['auto']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
