"""Does the cost model rank plans as the machine does?

For each problem (the bench cases of ``bench/zoo.py``), several whole plans of the
same computation on the same 8 devices: the case's own marks (Megatron, the seed's
MindSpore marks, ...), MindSpore's literal all_reduce + slice form, ``semi_auto``,
data parallel, ZeRO-1, dp x mp, everything replicated. Each plan is compiled by
shardprop; the model predicts its step time (``passes.cost.modeled_step_time``:
every op's roofline compute, every collective's alpha-beta time) and the plans are
run, interleaved round by round, median of the repetitions. The figure is
Spearman's rank correlation of predicted against measured step time
(``scipy.stats.spearmanr``): over every plan of every problem, and within each
problem (what choosing a plan needs).

    python bench/cost_model.py                       # the built-in CPU profile, 15 rounds
    python bench/cost_model.py --profile p.json      # a profile from `shardprop calibrate`
    python bench/cost_model.py --problems seed_network --reps 5
    python bench/cost_model.py --baseline old.json   # an older profile, scored on the same runs
    python bench/cost_model.py --limits 0.5,0.7,0.9 --cases gpt2_train_dp2xmp4
                                             # auto under limits against the hand plans that fit,
                                             # by CPU seconds per step beside the wall clock

CPU seconds (the whole process's, every device thread) are what a step on forced CPU
devices costs the cores: there a device that waits at a collective leaves its core to
another device, so on a quiet machine the wall time follows them, and under other
processes' load they move far less than the wall clock (docs/results/cost_model.md).

The default model (GPU-like figures, what propagation plans with unless told
otherwise) is scored beside the profile on the same measurements, and so is a
``--baseline`` profile (before and after a change to the model, side by side).
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import compare  # noqa: E402  (sets up 8 forced CPU devices before jax starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from bench import zoo  # noqa: E402
import shardprop as sp  # noqa: E402
from shardprop.passes.cost import DEFAULT_COST, CostModel, modeled_step_time  # noqa: E402


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def seed_one_all_reduce(x, w1, w2):
    """The seed network as MindSpore 2.10 plans it (issue 15, item 6): the first matmul's
    partial sum all-reduced once, relu ((2, 1)), the second matmul ((2, 1), (1, 4)) with its
    output left split: one collective where the seed document's plan has two."""
    h = zoo.annotate(jnp.matmul, (P("a", "b"), P("b", None)))(x, w1)
    return zoo.annotate(jnp.matmul, (P("a", None), P(None, "b")))(jax.nn.relu(h), w2)


def problems() -> dict:
    """{problem: [(plan name, case, annotate mode, mesh, parallelize kwargs)]}."""
    cases = {c.name: c for c in zoo.cases()}
    out = {}
    for name, batch in (("seed_network", (0,)), ("mindspore_ffn", (0,))):
        c = cases[name]
        m = _mesh(*c.mesh)
        out[name] = [("marks", c, "shardprop", m, {}),
                     ("marks, all_reduce + slice", c, "shardprop", m, dict(fuse_reduce_scatter=False)),
                     ("semi_auto", c, "shardprop", m, dict(mode="semi_auto")),
                     ("data parallel", c, "plain", _mesh((8,), ("d",)),
                      dict(mode="data_parallel", batch_argnums=batch)),
                     ("replicated", c, "plain", m, dict(mode="data_parallel", batch_argnums=()))]
    seed = cases["seed_network"]
    out["seed_network"].insert(2, ("one all_reduce (MindSpore 2.10)",
                                   dataclasses.replace(seed, name="seed_one_all_reduce", fn=seed_one_all_reduce),
                                   "shardprop", _mesh(*seed.mesh), {}))
    for name in ("megatron_mlp", "megatron_attention"):
        c = cases[name]
        m = _mesh(*c.mesh)
        seq = (P(None, "mp", None),) + (None,) * (4 if name == "megatron_attention" else 2)
        out[name] = [("megatron marks", c, "shardprop", m, {}),
                     ("semi_auto", c, "shardprop", m, dict(mode="semi_auto")),
                     ("sequence split", c, "plain", m, dict(in_strategy=seq)),
                     ("replicated", c, "plain", m, dict(mode="data_parallel", batch_argnums=()))]
    eight = _mesh((8,), ("dp",))
    state = dict(donate_argnums=(0, 1))
    for layers in (2, 12):
        mp8, dpmp = cases[f"gpt{layers}_train_mp8"], cases[f"gpt{layers}_train_dp2xmp4"]
        out[f"gpt{layers}_train"] = _gpt_plans(mp8, dpmp, eight, state)
    c = cases["cnn_data_parallel"]
    out["cnn_train"] = [
        ("marks (batch split)", c, "shardprop", _mesh(*c.mesh), dict(donate_argnums=(0,))),
        ("data parallel", c, "plain", _mesh(*c.mesh), dict(mode="data_parallel", batch_argnums=(1, 2),
                                                             donate_argnums=(0,))),
        ("replicated", c, "plain", _mesh(*c.mesh), dict(mode="data_parallel", batch_argnums=(), donate_argnums=(0,)))]
    return out


def _gpt_plans(mp8, dpmp, eight, state) -> list:
    """The GPT training step's plans: Megatron on 8, dp x mp, data parallel, ZeRO-1, replicated."""
    return [
        ("megatron mp8", mp8, "shardprop", _mesh(*mp8.mesh), state),
        ("dp2 x mp4", dpmp, "shardprop", _mesh(*dpmp.mesh), state),
        ("data parallel", mp8, "plain", eight, dict(mode="data_parallel", batch_argnums=(2, 3), **state)),
        ("ZeRO-1", mp8, "plain", eight, dict(mode="data_parallel", batch_argnums=(2, 3), shard_optimizer_state=True,
                                              **state)),
        ("replicated", mp8, "plain", eight, dict(mode="data_parallel", batch_argnums=(), **state))]


def build(case, mode, mesh, kwargs, args):
    """(plan, a callable running one step as a training loop would)."""
    zoo.annotate.mode, zoo.annotate.mesh = mode, mesh

    def fn(*a):   # a fresh function: a trace of the same one with other marks is not reused
        return case.fn(*a)
    pf = sp.parallelize(fn, mesh=mesh, progress=False, **kwargs)
    plan = pf.plan(*args)
    comp = pf.lower(*args).compile()
    compiled = pf._compile(args, {})
    return plan, compare.feedback(comp, pf._flat_inputs(compiled, args, {}), plan.graph.tied_outputs)


def measure(steps: list, reps: int) -> list[float]:
    """Median step time of each, run round by round (a slow spell hits every plan alike)."""
    for f in steps:
        jax.block_until_ready(f())
    times = [[] for _ in steps]
    for _ in range(reps):
        for i, f in enumerate(steps):
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def cpu_seconds() -> float:
    """CPU seconds this process (every device thread) has spent."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure_cpu(steps: dict, rounds: int, burst: int = 2) -> dict:
    """name -> (wall, CPU) median seconds per step of each of ``steps``, in turns, ``burst``
    steps a turn."""
    for f in steps.values():
        for _ in range(2):
            jax.block_until_ready(f())
    got = {k: ([], []) for k in steps}
    for _ in range(rounds):
        for k, f in steps.items():
            c, t = cpu_seconds(), time.perf_counter()
            for _ in range(burst):
                jax.block_until_ready(f())
            got[k][0].append((time.perf_counter() - t) / burst)
            got[k][1].append((cpu_seconds() - c) / burst)
    return {k: (statistics.median(w), statistics.median(c)) for k, (w, c) in got.items()}


def limits(case_names, fracs, rounds: int, profile) -> None:
    """auto under each limit (a fraction of the free plan's modeled peak) against the hand
    plans of ``compare.limited_hand_plans`` whose compiled peak fits, by CPU and wall."""
    for case in zoo.cases() + zoo.limit_cases():
        if case.name not in case_names:
            continue
        mesh = _mesh(*case.mesh)
        host = jax.tree_util.tree_map(np.array, case.args())
        fresh_args = lambda: jax.tree_util.tree_map(np.array, host)   # noqa: E731  (donated state is deleted)
        zoo.annotate.mode = "plain"
        reference = jax.jit(case.fn)(*case.args())
        free = sp.parallelize(compare.fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums,
                              progress=False, cost_model=profile).plan(*fresh_args())
        hands = {}
        for name, (mode, kw) in compare.limited_hand_plans(case).items():
            step, ok, comp = compare.hand_step(case, mesh, fresh_args(), reference, mode, kw)
            hands[name] = (step, compare.peak_memory(comp), ok)
        for frac in fracs:
            limit = int(frac * free.cost.peak_memory)
            zoo.annotate.mode = "plain"
            a = fresh_args()
            try:
                pf = sp.parallelize(compare.fresh(case.fn), mesh=mesh, mode="auto", progress=False,
                                    donate_argnums=case.state_argnums, cost_model=profile, memory_limit=limit)
                plan = pf.plan(*a)
                comp = pf.lower(*a).compile()
                compiled = pf._compile(a, {})
            except sp.ShardingError as e:
                print(f"{case.name} {frac}: auto failed: {str(e).splitlines()[0]}", flush=True)
                continue
            step = compare.feedback(comp, pf._flat_inputs(compiled, a, {}), plan.graph.tied_outputs)
            out = jax.tree_util.tree_unflatten(compiled.out_tree, list(step()))
            correct = compare.close(out, reference, case.train)   # before the timed steps donate its buffers
            fit = [k for k, h in hands.items() if h[1] <= limit]
            times = measure_cpu({"auto": step, **{k: hands[k][0] for k in fit}}, rounds)
            print(f"{case.name} {frac}: search {plan.pass_seconds['search-strategies']:.1f} s, modeled "
                  f"{plan.cost.step_time * 1e3:.2f} ms, peak / limit {compare.peak_memory(comp) / limit:.2f}, equal "
                  f"to one device {correct}", flush=True)
            print("   " + ", ".join(f"{k} CPU {c * 1e3:.1f} wall {w * 1e3:.1f} ms" for k, (w, c) in times.items()))
            if fit:
                by_cpu = min(fit, key=lambda k: times[k][1])
                by_wall = min(fit, key=lambda k: times[k][0])
                print(f"   auto / best hand: by CPU {times['auto'][1] / times[by_cpu][1]:.2f} ({by_cpu}), by wall "
                      f"{times['auto'][0] / times[by_wall][0]:.2f} ({by_wall}); over the limit: "
                      f"{[k for k in hands if k not in fit]}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="a profile from `shardprop calibrate` (default: the built-in 'cpu' one)")
    ap.add_argument("--baseline", help="another profile, scored on the same measurements (e.g. the one before)")
    ap.add_argument("--reps", type=int, default=15, help="timed rounds, median taken (default: 15)")
    ap.add_argument("--problems", nargs="*", help="run only these")
    ap.add_argument("--limits", help="auto under these memory limits (fractions of the free plan's modeled peak, "
                    "e.g. 0.5,0.7,0.9) against the hand plans that fit, by CPU seconds and wall (with --cases)")
    ap.add_argument("--cases", nargs="*", default=["gpt2_train_dp2xmp4"], help="(--limits) bench/zoo.py cases")
    args = ap.parse_args()
    profile = CostModel.load(args.profile) if args.profile else CostModel.builtin("cpu")
    if args.limits:
        limits(args.cases, [float(f) for f in args.limits.split(",")], args.reps, profile)
        return
    models = {"profile": profile, "default": DEFAULT_COST}
    if args.baseline:
        models["baseline"] = CostModel.load(args.baseline)
    rows = []
    start = time.perf_counter()
    for problem, plans in problems().items():
        if args.problems and problem not in args.problems:
            continue
        print(f"... {problem}", file=sys.stderr, flush=True)
        built = []
        for name, case, mode, mesh, kwargs in plans:
            try:
                plan, step = build(case, mode, mesh, kwargs, case.args())
            except sp.ShardingError as e:
                print(f"   {name}: not planned ({str(e).splitlines()[0]})", file=sys.stderr)
                continue
            predicted = {k: modeled_step_time(plan.graph, m.check_mesh(plan.graph.mesh)) for k, m in models.items()}
            built.append((name, plan, step, predicted))
        measured = measure([b[2] for b in built], args.reps)
        for (name, plan, _, predicted), t in zip(built, measured):
            rows.append(dict(problem=problem, plan=name, measured=t, collectives=predicted["profile"]["collectives"],
                             launched=predicted["profile"]["launched"],
                             bytes=plan.bytes, **{f"{k}_{part}": p[part] for k, p in predicted.items()
                                                  for part in ("compute", "communication", "total")}))
    base = "baseline" in models
    print(f"{'problem':<20} {'plan':<31} {'colls':>5} {'launch':>6} {'bytes':>9} {'measured':>10} {'profile':>10} "
          f"{'(comm)':>9} " + (f"{'baseline':>10} " if base else "") + f"{'default':>10}")
    for r in rows:
        print(f"{r['problem']:<20} {r['plan']:<31} {r['collectives']:>5} {r['launched']:>6} {compare.fmt_bytes(r['bytes']):>9} "
              f"{r['measured'] * 1e3:>8.3f}ms {r['profile_total'] * 1e3:>8.3f}ms "
              f"{r['profile_communication'] * 1e3:>7.3f}ms "
              + (f"{r['baseline_total'] * 1e3:>8.3f}ms " if base else "") +
              f"{r['default_total'] * 1e6:>8.2f}us")
    print()
    for k in models:
        pooled = spearmanr([r[f"{k}_total"] for r in rows], [r["measured"] for r in rows]).statistic
        per = {}
        for problem in dict.fromkeys(r["problem"] for r in rows):
            sub = [r for r in rows if r["problem"] == problem]
            if len(sub) > 2:
                per[problem] = spearmanr([r[f"{k}_total"] for r in sub], [r["measured"] for r in sub]).statistic
        within = ", ".join(f"{p} {s:+.2f}" for p, s in per.items())
        print(f"Spearman, {k} model ({models[k].name or 'built-in default'}): "
              f"all {len(rows)} plans {pooled:+.3f}; within each problem: {within}; "
              f"mean {statistics.mean(per.values()) if per else float('nan'):+.2f}")
    print(f"\nmeasured: median of {args.reps} interleaved rounds per problem on 8 forced CPU devices; predicted: "
          f"modeled_step_time (compute per device, alpha-beta collectives, no dispatch overhead)")
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
