"""How long ``mode="auto"`` takes to plan a GPT training step, and what it plans.

Traces the GPT training step of examples/gpt_megatron.py (forward, backward, Adam)
with no marks at all, and runs the pipeline with the strategy search
(passes/auto) on each mesh: 8 devices (the search tries 2 x 4 and 4 x 2), and
the named meshes 2 x 4 and 4 x 2 ("dp", "mp"). Prints, per depth and mesh, the
median over --repeat runs of the search pass's seconds (building the problem and
solving it), the whole pipeline's, the solver's own seconds, the size of the
MILP, and the plan's modeled step time, bytes moved and peak per device.

    python bench/auto.py                       # 12 and 48 layers
    python bench/auto.py --layers 12 --repeat 3 --embed 256 --batch 16
    python bench/auto.py --layers 2 --meshes 2x4 --limits 0.8 0.6   # under memory limits, each memory method

With --limits: the plan without a limit, then under each fraction of its modeled
peak, searched by each memory method in turn ("rounded": the default, the rows' LP
relaxation rounded first, exact rows where its proven gap is above 5%; "lagrange":
multipliers first, exact rows where they leave a gap above 1%; "exact": exact rows
only), the median search
seconds of --repeat, the plan's modeled step and peak, and how the solver ended.
"""
import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import jax  # noqa: E402

import gpt_megatron as M  # noqa: E402
from shardprop.compiler.pipeline import Options, gc_paused, run_pipeline  # noqa: E402
from shardprop.compiler.state import state_ties  # noqa: E402
from shardprop.compiler.trace import import_jaxpr, input_names  # noqa: E402
from shardprop.passes.redistribute import clear_caches as clear_redistribution_caches  # noqa: E402
from shardprop.runtime.mesh import resolve_mesh  # noqa: E402

REAL_SP = M.sp
NO_MARKS = types.SimpleNamespace(shard=lambda fn, *a, **k: fn)
M.sp = NO_MARKS   # the model without a single mark

MESHES = {"8": 8, "2x4": ((2, 4), ("dp", "mp")), "4x2": ((4, 2), ("dp", "mp"))}


def traced(layers: int, heads: int, head_dim: int, batch: int, seq: int):
    cfg = M.Config(layers=layers, heads=heads, head_dim=head_dim, batch=batch, seq=seq)
    params = M.init_params(cfg)
    tokens, targets = M.make_batch(cfg)
    step, opt = M.make_train_step(M.Parallelism(heads=None, columns=None), cfg)   # (no marks: shard is identity)
    args = (params, opt.init(params), tokens, targets)
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*args)
    return step, args, closed, out_shape


def plan_once(step, args, closed, out_shape, mesh) -> dict:
    clear_redistribution_caches()   # every run pays for its redistribution costs (no warm cache)
    with gc_paused():
        graph = unmarked_graph(step, args, closed, out_shape, mesh)
        t0 = time.perf_counter()
        res = run_pipeline(graph, Options(mode="auto"))
        total = time.perf_counter() - t0
    auto = res.graph.auto
    return dict(search=res.seconds["search-strategies"], total=total, solver=auto.solver["seconds"],
                variables=auto.solver["variables"], binaries=auto.solver["binaries"], nodes=auto.solver["nodes"],
                decisions=auto.solver["decisions"], step=auto.step_time, bytes=auto.bytes_moved,
                peak=auto.peak_memory, mesh=auto.mesh, gap=auto.solver["gap"], ops=len(graph.ops))


def unmarked_graph(step, args, closed, out_shape, mesh):
    spec = resolve_mesh(mesh)
    graph = import_jaxpr(closed, spec.ir_mesh, input_names(step, args, {}), "train_step")
    graph.count_mesh = not spec.named
    graph.tied_outputs = state_ties(args, (0, 1), out_shape)
    return graph


def under_limits(t, mesh, fractions, methods, repeat, budget=True) -> None:
    """Search under memory limits (fractions of the free plan's modeled peak), each memory
    method in turn per repetition, so the figures of one line are measured side by side."""
    from shardprop.passes.auto import SearchStrategies
    from shardprop.passes.bind_strategies import BindUserStrategies
    g = BindUserStrategies()(unmarked_graph(*t, mesh))
    _, free, free_peak = SearchStrategies().search(g)
    print(f"  free plan: step {free.modeled * 1e3:.4f} ms, peak {free_peak / 1e6:.3f} MB", flush=True)
    for frac in fractions:
        limit = int(frac * free_peak)
        seconds = {m: [] for m in methods}
        found = {}
        for _ in range(repeat):
            for m in methods:
                clear_redistribution_caches()
                t0 = time.perf_counter()
                # "rounded": the default (the rows' LP rounded first, then exact rows);
                # "exact": exact rows only; "lagrange": multipliers first
                options = dict(memory_method="exact", relaxed_gap=None) if m == "exact" else \
                    dict(memory_method="lagrange", relaxed_gap=None) if m == "lagrange" else {}
                search = SearchStrategies(memory_limit=limit, **options)
                if budget:   # (as parallelize runs it: one time budget, TIME_BUDGET seconds)
                    search._deadline = time.perf_counter() + search.time_budget
                _, sol, peak = search.search(g)
                seconds[m].append(time.perf_counter() - t0)
                found[m] = (sol, peak)
        for m in methods:
            sol, peak = found[m]
            how = "no plan fits" if sol is None else (f"step {sol.modeled * 1e3:.4f} ms, peak {peak / 1e6:.3f} MB, "
                                                     f"{sol.rounds} solves, gap {sol.gap:.1%}; {_short(sol.status)}")
            print(f"  limit {frac:g} x free ({limit / 1e6:.3f} MB) {m:>8}: search {statistics.median(seconds[m]):6.2f} s"
                  f" | {how}", flush=True)


def _short(status: str) -> str:
    return status.replace("Optimization terminated successfully. (HiGHS Status 7: Optimal)", "exact rows: optimal")


def repeated_matmuls(graph, strategies: dict) -> int:
    """Matmuls whose strategy leaves some devices computing the same work (their factors
    do not use every mesh axis)."""
    mesh = graph.mesh
    return sum(mesh.axes_size(tuple(a for f in strategies[op].factors for a in f)) < mesh.size
               for op in graph.ops if op.kind == "dot_general")


def hand_vs_auto(layers, heads, head_dim, batch, seq, mesh, pressure=None) -> dict:
    """Modeled step time of Megatron's hand plan (dp x mp marks, propagated) and of the
    auto plan, both priced op by op on the unmarked program by the same cost model;
    ``pressure``: auto searches under a memory limit of that fraction of the hand plan's
    modeled peak."""
    from shardprop.ir.graph import CONSTRAINT
    from shardprop.passes.auto.memory import plan_peak
    from shardprop.passes.auto.problem import Problem
    from shardprop.passes.bind_strategies import BindUserStrategies
    from shardprop.passes.cost import DEFAULT_COST
    from shardprop.passes.propagate import PropagateSharding
    from shardprop.passes.auto import SearchStrategies
    spec = resolve_mesh(mesh)
    cfg = M.Config(layers=layers, heads=heads, head_dim=head_dim, batch=batch, seq=seq)
    params = M.init_params(cfg)
    tokens, targets = M.make_batch(cfg)
    graphs = {}
    for name, sp_module in (("hand", REAL_SP), ("auto", NO_MARKS)):
        M.sp = sp_module
        step, opt = M.make_train_step(M.Parallelism.data_and_tensor(), cfg)
        args = (params, opt.init(params), tokens, targets)
        with jax.set_mesh(spec.trace_mesh()):
            closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*args)
        g = import_jaxpr(closed, spec.ir_mesh, input_names(step, args, {}), "train_step")
        g.tied_outputs = state_ties(args, (0, 1), out_shape)
        graphs[name] = BindUserStrategies()(g)
    M.sp = NO_MARKS
    hand, auto = graphs["hand"], graphs["auto"]
    PropagateSharding()(hand)
    marked_ops = [op for op in hand.ops if op.kind != CONSTRAINT]
    assert [op.kind for op in marked_ops] == [op.kind for op in auto.ops], "the two traces differ beyond the marks"
    ops = {u: h.strategy for h, u in zip(marked_ops, auto.ops)}
    inputs = {i: v.layout for i, v in enumerate(hand.inputs)}
    problem = Problem(auto, DEFAULT_COST)
    e = problem.evaluate(ops, inputs)
    hand_peak = plan_peak(auto, ops, inputs)
    t0 = time.perf_counter()
    SearchStrategies(memory_limit=None if pressure is None else int(pressure * hand_peak))(auto)
    return dict(hand=e["compute"] + e["communication"], hand_bytes=e["bytes"], hand_peak=hand_peak,
                hand_repeated=repeated_matmuls(auto, ops), auto=auto.auto.step_time, auto_bytes=auto.auto.bytes_moved,
                auto_peak=auto.auto.peak_memory, auto_repeated=repeated_matmuls(auto, {op: op.strategy for op in auto.ops}),
                seconds=time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--hand", action="store_true", help="also price Megatron's dp x mp hand plan on the named meshes")
    ap.add_argument("--pressure", type=float, default=None,
                    help="with --hand: auto's memory limit, as a fraction of the hand plan's modeled peak")
    ap.add_argument("--limits", type=float, nargs="+", default=None,
                    help="search under memory limits, fractions of the unlimited plan's modeled peak")
    ap.add_argument("--memory-methods", nargs="+", default=["rounded", "exact"], choices=["rounded", "lagrange", "exact"],
                    help="rounded: the default search (the memory rows' LP rounded first, exact rows where its gap is "
                         "above 5%%); exact: exact rows only; lagrange: multipliers first")
    ap.add_argument("--no-budget", action="store_true",
                    help="with --limits: no time budget (each solve its time limit), as before 2026-11-27")
    args = ap.parse_args()
    if args.limits:
        print(f"GPT training step (Adam), no marks, under memory limits; heads {args.heads} x {args.head_dim}, batch "
              f"{args.batch}, seq {args.seq}; median search seconds of {args.repeat}, methods in turns")
        for layers in args.layers:
            t = traced(layers, args.heads, args.head_dim, args.batch, args.seq)
            for name in args.meshes:
                print(f"{layers} layers, mesh {name}:", flush=True)
                under_limits(t, MESHES[name], args.limits, args.memory_methods, args.repeat, not args.no_budget)
        return
    if args.hand:
        print("modeled step (ms), bytes moved (MB), peak (MB) per device and matmuls computed more than once: "
              "Megatron dp x mp marks vs auto" + (f" under {args.pressure:g} x the hand plan's peak" if args.pressure else ""))
        for layers in args.layers:
            for name in args.meshes:
                if name == "8":
                    continue
                r = hand_vs_auto(layers, args.heads, args.head_dim, args.batch, args.seq, MESHES[name], args.pressure)
                print(f"{layers:>3} layers {name}: hand {r['hand'] * 1e3:.3f} ms {r['hand_bytes'] / 1e6:.1f} MB "
                      f"peak {r['hand_peak'] / 1e6:.1f} repeated {r['hand_repeated']} | auto {r['auto'] * 1e3:.3f} ms "
                      f"{r['auto_bytes'] / 1e6:.1f} MB peak {r['auto_peak'] / 1e6:.1f} repeated {r['auto_repeated']} "
                      f"| auto/hand {r['auto'] / r['hand']:.3f} (search {r['seconds']:.1f} s)", flush=True)
        return
    print(f"GPT training step (Adam), no marks; heads {args.heads} x {args.head_dim}, batch {args.batch}, "
          f"seq {args.seq}; medians of {args.repeat}")
    print(f"{'layers':>6} {'mesh':>5} {'ops':>6} {'search s':>9} {'solver s':>9} {'pipeline s':>10} {'nodes':>6} "
          f"{'decisions':>9} {'MILP vars':>9} {'step ms':>9} {'MB moved':>9} {'peak MB':>8}  chosen mesh")
    for layers in args.layers:
        t = traced(layers, args.heads, args.head_dim, args.batch, args.seq)
        for name in args.meshes:
            runs = [plan_once(*t, MESHES[name]) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("search", "solver", "total")}
            r = runs[-1]
            print(f"{layers:>6} {name:>5} {r['ops']:>6} {med['search']:>9.2f} {med['solver']:>9.2f} "
                  f"{med['total']:>10.2f} {r['nodes']:>6} {r['decisions']:>9} {r['variables']:>9} "
                  f"{r['step'] * 1e3:>9.4f} {r['bytes'] / 1e6:>9.3f} {r['peak'] / 1e6:>8.2f}  {r['mesh']}",
                  flush=True)


if __name__ == "__main__":
    main()
