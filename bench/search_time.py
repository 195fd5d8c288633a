"""How long ``mode="auto"`` takes to plan under a memory limit, and what it plans.

The GPT training step of the zoo (``bench/zoo.py``'s ``gpt_case``: forward, backward,
Adam; heads 8 x 16, seq 32, batch 8, vocab 256) with no marks, planned by the
strategy search (passes/auto) under memory limits that are fractions of the free
plan's modeled peak, on each mesh: 8 devices (the search tries 2 x 4 and 4 x 2), and
the named meshes 2 x 4 and 4 x 2 ("dp", "mp"). Repetitions are interleaved (each
round runs every limit once), and every search starts cold: the redistribution
prices, the hand plans' solves and the warm LP models are cleared before each.

Per depth, mesh and limit it prints the median of ``--repeat`` runs of the search's
seconds, by the wall clock and by ``time.process_time()`` (the machine is shared),
and the plan of the last run: its modeled step as the objective prices it and as
written, its modeled peak against the limit, the gap the search proved, how it ended,
and where the search's seconds went (``plan.cost.solver["phases"]``).

    python bench/search_time.py --layers 2 --meshes 4x2 --limits 0.5 0.7 0.9
    python bench/search_time.py --layers 2 12 48 --repeat 3
    python bench/search_time.py --layers 2 --compiled     # parallelize().plan(): the memory
                                                          # check's compiles and searches again
    python bench/search_time.py --layers 2 --meshes 4x2 --limits 0.5 --repeat 1 --lp-log
                                                          # and each warm LP solve's seconds
    python bench/search_time.py --layers 2 --limits 0.5 --budget 5   # under a shorter budget
    python bench/search_time.py --layers 2 --family-lps   # the hand families' LPs alone, in
                                                          # their own order and in the warm one

Without ``--compiled`` one search runs on the traced program (``SearchStrategies``
with its own time budget), which is what the search-time goals are about; with it,
``parallelize(..., memory_limit=).plan()`` runs as a user's would: the plan is
compiled, and where XLA's peak is over the limit the search runs again under a lower
modeled limit (``compiler/memory_check.py``). Its seconds are the whole ``plan()``,
and the searches' sum beside them.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import zoo  # noqa: E402
from bench.compare import fresh  # noqa: E402
import shardprop as sp  # noqa: E402
from shardprop.compiler.pipeline import gc_paused, run_pipeline  # noqa: E402
from shardprop.passes.auto import hand, memo  # noqa: E402
from shardprop.passes.auto.search import TIME_BUDGET, SearchStrategies  # noqa: E402
from shardprop.passes.bind_strategies import BindUserStrategies  # noqa: E402
from shardprop.passes.redistribute import clear_caches as clear_redistribution_caches  # noqa: E402

MESHES = {"8": 8, "2x4": ((2, 4), ("dp", "mp")), "4x2": ((4, 2), ("dp", "mp"))}


def cold() -> None:
    """Forget what an earlier search left: prices, hand plans' solves, warm LP models."""
    clear_redistribution_caches()
    memo.forget()


def case_of(layers: int, mesh_name: str):
    shape = (2, 4) if mesh_name == "8" else MESHES[mesh_name][0]
    case = zoo.gpt_case(layers, 2, shape)
    zoo.annotate.mode = "plain"   # no marks: the program mode="auto" plans
    return case, jax.tree_util.tree_map(np.array, case.args())


def parallelized(case, mesh_name: str, cost_model: str, limit=None):
    return sp.parallelize(fresh(case.fn), mesh=MESHES[mesh_name], mode="auto", donate_argnums=case.state_argnums,
                          progress=False, cost_model=cost_model, memory_limit=limit)


def bound_graph(pf, args):
    """The traced program with its marks and tied state bound, as the search finds it."""
    g, _ = pf._trace(args, {})
    return run_pipeline(g, pf.options, passes=[BindUserStrategies()]).graph


def search_once(pf, args, limit, budget=None) -> dict:
    """One cold search on the traced program (its own time budget: ``budget`` seconds,
    None for the search's default)."""
    graph = bound_graph(pf, args)
    cold()
    with gc_paused():
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            SearchStrategies(pf.options.cost, limit, time_budget=TIME_BUDGET if budget is None else budget)(graph)
        except sp.ShardingError as e:
            return dict(wall=time.perf_counter() - t0, cpu=time.process_time() - c0, error=str(e).splitlines()[0])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lp = [entry for model in memo.WARM_MODELS.values() for entry in getattr(model, "log", [])]
    return dict(wall=wall, cpu=cpu, lp=lp, **summary(graph.auto))


def plan_once(pf, args) -> dict:
    """``pf.plan(*args)`` cold: the search, the memory check's compiles and its searches again."""
    seconds = []
    inner = SearchStrategies.__call__

    def timed(self, graph):
        t0 = time.perf_counter()
        try:
            return inner(self, graph)
        finally:
            seconds.append(time.perf_counter() - t0)
    cold()
    SearchStrategies.__call__ = timed
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        plan = pf.plan(*args)
        out = dict(wall=time.perf_counter() - t0, cpu=time.process_time() - c0, **summary(plan.cost))
    except sp.ShardingError as e:
        out = dict(wall=time.perf_counter() - t0, cpu=time.process_time() - c0, error=str(e).splitlines()[0])
    finally:
        SearchStrategies.__call__ = inner
    out.update(searches=len(seconds), search_wall=sum(seconds))
    return out


def family_lps(pf, args, repeat: int) -> None:
    """The hand families' LPs alone on one warm model, solved in the families' own order
    and in ``hand._warm_order`` (a fresh model per run, interleaved): seconds and simplex
    iterations, summed over the families."""
    from shardprop.passes.auto import milp, warm_lp
    from shardprop.passes.auto.problem import Problem
    graph = bound_graph(pf, args)
    search = SearchStrategies(pf.options.cost)
    graph.set_mesh(search._arrangements(graph)[0])
    cold()
    problem = Problem(graph, pf.options.cost)
    fams = hand.families(problem)
    red = milp.reduce(problem, memory_matters=True, also=[f.allowed for f in fams if f.allowed is not None])
    orders = {"families' order": list(range(len(fams))), "warm order": hand._warm_order(problem, fams)}
    runs = {name: [] for name in orders}
    for _ in range(repeat):
        for name, order in orders.items():
            model = warm_lp.WarmLP(red)
            t0 = time.perf_counter()
            for k in order:
                if fams[k].allowed is not None:
                    model.solve(fams[k].allowed)
            runs[name].append((time.perf_counter() - t0, sum(entry[2] for entry in model.log)))
    for name, order in orders.items():
        print(f"  {name:<16} {order}: {statistics.median(r[0] for r in runs[name]):6.2f} s, "
              f"{statistics.median(r[1] for r in runs[name]):.0f} simplex iterations "
              f"(median of {repeat})", flush=True)


def summary(res) -> dict:
    s = res.solver
    return dict(step=res.step_time, written=res.written_time or res.step_time, peak=res.peak_memory,
                modeled_limit=res.modeled_limit, gap=s.get("gap", 0.0), status=s.get("status", ""),
                phases=s.get("phases", {}), mesh=res.mesh)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2])
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--limits", type=float, nargs="+", default=[0.5, 0.7, 0.9],
                    help="memory limits, fractions of the free plan's modeled peak")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cost-model", default="cpu", help="the cost model auto plans with (bench/compare.py's default)")
    ap.add_argument("--compiled", action="store_true", help="parallelize().plan(): with the memory check's rounds")
    ap.add_argument("--lp-log", action="store_true",
                    help="each warm LP solve of the last run: wall s, process s, simplex iterations, rows, status")
    ap.add_argument("--budget", type=float, default=None,
                    help="the search's time budget in seconds (default: the search's own)")
    ap.add_argument("--family-lps", action="store_true",
                    help="only the hand families' LPs, in their own order and in the warm order")
    args = ap.parse_args()
    print(f"GPT training step (zoo: heads 8 x 16, seq 32, batch 8, Adam), no marks, cost model {args.cost_model}; "
          f"{'plan() with the memory check' if args.compiled else 'one search'}, cold; medians of {args.repeat} "
          f"interleaved runs (wall s / process_time s); the plan of the last run", flush=True)
    for layers in args.layers:
        for name in args.meshes:
            case, host = case_of(layers, name)
            free = parallelized(case, name, args.cost_model)
            if args.family_lps:
                print(f"{layers} layers, mesh {name}: the hand families' LPs", flush=True)
                family_lps(free, host, args.repeat)
                continue
            g = bound_graph(free, host)
            cold()
            SearchStrategies(free.options.cost)(g)
            free_peak, free_step = g.auto.peak_memory, g.auto.step_time
            print(f"{layers} layers, mesh {name}: {len(g.ops)} ops; free plan {free_step * 1e3:.4f} ms, "
                  f"peak {free_peak / 1e6:.3f} MB", flush=True)
            runs = {f: [] for f in args.limits}
            for _ in range(args.repeat):
                for frac in args.limits:
                    limit = int(frac * free_peak)
                    pf = parallelized(case, name, args.cost_model, limit)
                    a = jax.tree_util.tree_map(np.array, host)
                    runs[frac].append(plan_once(pf, a) if args.compiled else search_once(pf, a, limit, args.budget))
            for frac in args.limits:
                rs = runs[frac]
                wall = statistics.median(r["wall"] for r in rs)
                cpu = statistics.median(r["cpu"] for r in rs)
                r = rs[-1]
                head = f"  limit {frac:g} ({int(frac * free_peak) / 1e6:.3f} MB): {wall:6.2f} s / {cpu:6.2f} s cpu"
                if args.compiled:
                    head += f" ({r['searches']} searches, {r['search_wall']:.2f} s)"
                if "error" in r:
                    print(f"{head} | {r['error'][:160]}", flush=True)
                    continue
                phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
                print(f"{head} | step {r['step'] * 1e3:.4f} ms (written {r['written'] * 1e3:.4f}), peak "
                      f"{r['peak'] / 1e6:.3f} MB / limit {r['modeled_limit'] / 1e6:.3f}, gap {r['gap']:.2%} on "
                      f"{r['mesh']} | {r['status'][:110]}" + (f" | phases: {phases}" if phases else ""), flush=True)
                if args.lp_log and r.get("lp"):
                    print("    warm LP solves (wall s / process s, iterations, rows): " + "; ".join(
                        f"{w:.2f}/{c:.2f} {it} it {n} rows" + ("" if st == "Optimal" else f" ({st})")
                        for w, c, it, n, st in r["lp"]), flush=True)


if __name__ == "__main__":
    main()
