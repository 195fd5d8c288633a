"""Why auto under a memory limit does or does not return a zoo case's marks: the marks'
plan priced by the model auto plans with, beside auto's plan and its hand plans.

For a case of ``bench/zoo.py`` with marks (the GPT steps' Megatron marks): the marks'
plan is propagated as ``parallelize`` plans it, then priced by the one evaluator
(``plan_core.evaluate``) two ways: as written (a value moved to one layout for several
ops is moved once: what ``insert-reshards`` writes and propagation prices) and per
reader (the search's linear objective), and its modeled peak (``auto.memory``).
Then, on the unmarked program: whether each of the marks' argument layouts is among
auto's candidates; the search's problem solved with the arguments held to the marks'
layouts (what the warm start would be, were the marks one of its hand plans); and
auto's plan under each limit (a fraction of the free plan's modeled peak), with its
objective, written price and peak, and every hand plan the search compared with.
It answers, in numbers: is the marks' plan over the modeled limit, priced above auto's,
or missing from the warm starts? On a mesh of two axes the same for the bench's tp+FSDP
(the marks with ``shard_params=True``, ``bench/compare.py``), and for both where the
written price goes: the moves as written, by what they move (a stored value gathered at
its use, another value, a terminal value at the step's end), their count and seconds,
and how much of those seconds is the profile's wait after compute (``sync_s``).

    python bench/auto_marks.py --cases gpt2_train_dp2xmp4 --limits 0.7,0.9
    python bench/auto_marks.py --cases gpt2_train_dp2xmp4 --cost-model bench/results/h200-2026-11-27/cpu16.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

from bench import zoo  # noqa: E402
from bench.compare import fresh  # noqa: E402
import shardprop as sp  # noqa: E402
from shardprop.compiler.pipeline import run_pipeline  # noqa: E402
from shardprop.passes.auto import hand  # noqa: E402
from shardprop.passes.auto.memory import plan_peak  # noqa: E402
from shardprop.passes.auto.problem import Problem  # noqa: E402
from shardprop.passes.auto.search import _Liveness  # noqa: E402
from shardprop.passes.bind_strategies import BindUserStrategies  # noqa: E402
from shardprop.passes.plan_core.context import PlanContext, RuleBook  # noqa: E402
from shardprop.passes.plan_core.evaluate import evaluate_plan  # noqa: E402
from shardprop.passes.plan_core.pricing import Prices  # noqa: E402
from shardprop.passes.propagate import PropagateSharding  # noqa: E402
from shardprop.passes.redistribute import plan_redistribution  # noqa: E402


def marks_plan(case, mesh, cost_model, args, **kw) -> dict:
    """The marks' plan as propagation writes it: per op its strategy (the marks'
    sharding constraints left out, so it maps onto the unmarked program's ops in
    order), its arguments' layouts, and its price as written, per reader and peak on
    its own (marked) graph. ``kw``: more ``parallelize`` keywords (``shard_params=True``:
    the bench's tp+FSDP, whose gathers at use are sharding constraints too)."""
    zoo.annotate.mode, zoo.annotate.mesh = "shardprop", mesh
    pf = sp.parallelize(fresh(case.fn), mesh=mesh, donate_argnums=case.state_argnums, progress=False,
                        cost_model=cost_model, **kw)
    cost = pf.options.cost
    g, _ = pf._trace(args, {})
    run_pipeline(g, pf.options, passes=[BindUserStrategies(),
                                        PropagateSharding("sharding_propagation", cost, True, whole_round=True)])
    ctx = PlanContext(g, RuleBook())
    ops = {op: op.strategy for op in g.ops}
    inputs = {i: v.layout for i, v in enumerate(g.inputs)}
    priced = {}
    for shared in (True, False):
        e = evaluate_plan(ctx, ops, inputs, Prices(cost, True), ctx.compute_times(cost, g.mesh),
                          shared_copies=shared, detail=False)
        priced[shared] = e["compute"] + e["communication"]
    return dict(cost=cost, written=priced[True], per_reader=priced[False], peak=plan_peak(g, ops, inputs),
                strategies=[op.strategy for op in g.ops if op.kind != "sharding_constraint"],
                kinds=[op.kind for op in g.ops if op.kind != "sharding_constraint"],
                inputs=[v.layout for v in g.inputs])


def unmarked_problem(case, mesh, cost_model, args):
    zoo.annotate.mode = "plain"
    pf = sp.parallelize(fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums, progress=False,
                        cost_model=cost_model)
    g, _ = pf._trace(args, {})
    run_pipeline(g, pf.options, passes=[BindUserStrategies()])
    return g, Problem(g, pf.options.cost)


def marks_on_the_problem(problem: Problem, marks: dict) -> dict:
    """The marks' plan on auto's problem: priced (both ways), its arguments' layouts
    among the candidates or not, and the problem solved with them held."""
    g = problem.graph
    out = dict(missing=[], same_ops=[op.kind for op in g.ops] == marks["kinds"])
    inputs = dict(enumerate(marks["inputs"]))
    if out["same_ops"]:
        ops = dict(zip(g.ops, marks["strategies"]))
        e = problem.evaluate(ops, inputs)
        written, moves = moves_by_what(problem, ops, inputs)
        out.update(per_reader=e["compute"] + e["communication"], compute=e["compute"], written=written,
                   peak=plan_peak(g, ops, inputs), moves=moves)
    allowed = {}
    for i, v in enumerate(g.inputs):
        if v not in problem.owner:
            continue
        node = problem.nodes[problem.owner[v][0]]
        ks = [k for k, lay in enumerate(node.candidates) if lay == marks["inputs"][i]]
        if not ks:
            out["missing"].append((i, v.type.shape, str(marks["inputs"][i])))
            continue
        t = node.template
        allowed[t] = np.array(ks) if t not in allowed else np.intersect1d(allowed[t], ks)
    memory = _Liveness(g, problem)
    held = hand.hand_plans(problem, lambda c: memory.peak(c)[0], None,
                           fams=[hand.Family("marks' arguments", "as marked", allowed)])[0]
    out["held"] = held
    return out


def moves_by_what(problem: Problem, ops: dict, inputs: dict) -> tuple:
    """(the plan's price as written, ``Problem.written``; its moves as written, by what they
    move): "stored" (an argument, its cast or view: a gather at its use), "terminal" (a
    value nothing computes on before the step's end: a gradient), "value" (the rest) ->
    [count, seconds, of which the profile's wait after compute]. A stored value's gathers are one per use; another
    value's move, once per layout. The wait: its group's, once per move (``CostModel.move_time``), a
    terminal one's shared by its riders."""
    out: dict = {}
    prices, real = problem.prices, problem.prices.move
    cost = problem.cost

    def tallied(v, src, dst, mesh, step_end):
        t = real(v, src, dst, mesh, step_end)
        if t > 0:
            terminal = v in step_end.terminal
            what = "stored" if v in problem.ctx.stored else "terminal" if terminal else "value"
            row = out.setdefault(what, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += t
            model = step_end.cost_for(cost, v)
            try:
                steps = plan_redistribution(tuple(v.type.shape), v.type.itemsize, src, dst, mesh, True, model)
                row[2] += model.move_time(steps, mesh) - model.back_to_back.move_time(steps, mesh)
            except ValueError:
                pass
        return t
    prices.move = tallied
    try:
        written = problem.written(ops, inputs)
    finally:
        del prices.move    # (the instance attribute shadowed the method)
    return written, out


def moves_text(moves: dict) -> str:
    return "; ".join(f"{what} {n} moves {t * 1e3:.1f} ms (wait after compute {w * 1e3:.1f})"
                     for what, (n, t, w) in sorted(moves.items()))


def ms(t) -> str:
    return "-" if t is None else f"{t * 1e3:.4f}"


def run(case, cost_model, fracs) -> None:
    shape, names = case.mesh
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
    args = jax.tree_util.tree_map(np.array, case.args())
    zoo.annotate.mode = "plain"
    free = sp.parallelize(fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums,
                          progress=False, cost_model=cost_model).plan(*args)
    marks = marks_plan(case, mesh, cost_model, args)
    g, problem = unmarked_problem(case, mesh, cost_model, args)
    on = marks_on_the_problem(problem, marks)
    tp_fsdp = marks_on_the_problem(problem, marks_plan(case, mesh, cost_model, args, shard_params=True)) \
        if len(shape) > 1 else {}
    print(f"\n{case.name} on {'x'.join(map(str, shape))}, model {marks['cost'].name or 'default'}: free plan "
          f"{ms(free.cost.step_time)} ms, modeled peak {free.cost.peak_memory / 2**20:.3f} MiB")
    print(f"  marks, propagated (marked graph): {ms(marks['written'])} ms as written, {ms(marks['per_reader'])} ms "
          f"a copy per reader, modeled peak {marks['peak'] / 2**20:.3f} MiB")
    for what, o in (("marks", on), ("tp+FSDP (the marks, shard_params=True)", tp_fsdp)):
        if o.get("same_ops"):
            print(f"  {what} on auto's problem (unmarked graph): {ms(o['written'])} ms as written, "
                  f"{ms(o['per_reader'])} ms a copy per reader, modeled peak {o['peak'] / 2**20:.3f} MiB\n"
                  f"    moves as written: {moves_text(o['moves'])}")
    print(f"  marks' argument layouts missing from auto's candidates: {len(on['missing'])}"
          + "".join(f"\n    input {i} {s}: {lay}" for i, s, lay in on["missing"][:10]))
    h = on["held"]
    print(f"  auto's problem with the arguments held to the marks' layouts: {ms(h.time)} ms a copy per reader, "
          f"{ms(h.written)} ms as written, peak {(h.peak or 0) / 2**20:.3f} MiB")
    for frac in fracs:
        limit = int(frac * free.cost.peak_memory)
        zoo.annotate.mode = "plain"
        t0 = time.perf_counter()
        plan = sp.parallelize(fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums,
                              progress=False, cost_model=cost_model, memory_limit=limit).plan(*args)
        c = plan.cost
        held_to = c.modeled_limit or limit
        peak = on.get("peak", marks["peak"])
        print(f"  limit {frac} ({limit / 2**20:.3f} MiB, modeled peak held to {held_to / 2**20:.3f}), plan() "
              f"{time.perf_counter() - t0:.1f} s: auto {ms(c.solver.get('objective'))} ms solved, {ms(c.step_time)} "
              f"refined, {ms(c.written_time)} as written, peak {c.peak_memory / 2**20:.3f} MiB, "
              f"{c.bytes_moved / 1e6:.2f} MB moved; the marks {'fit' if peak <= held_to else 'do not fit'} "
              f"the model, {(on.get('written', marks['written']) / c.written_time - 1) * 100:+.1f}% against auto "
              f"as written (on auto's problem)"
              + (f"; tp+FSDP {'fits' if tp_fsdp['peak'] <= held_to else 'does not fit'} the model, "
                 f"{(tp_fsdp['written'] / c.written_time - 1) * 100:+.1f}% against auto as written"
                 if tp_fsdp.get("same_ops") else ""))
        print(f"    {c.solver.get('status', '')}")
        for hp in c.hand_plans:
            print(f"    {hp}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=["gpt2_train_dp2xmp4"])
    ap.add_argument("--limits", default="0.7,0.9", help="fractions of the free plan's modeled peak")
    ap.add_argument("--cost-model", default="cpu", help="a built-in profile name or a `shardprop calibrate` file")
    a = ap.parse_args()
    cost_model = a.cost_model if a.cost_model in ("cpu", "h100") else sp.CostModel.load(a.cost_model)
    fracs = [float(f) for f in a.limits.split(",")] if a.limits else []
    for case in zoo.cases() + zoo.limit_cases():
        if case.name in a.cases:
            run(case, cost_model, fracs)


if __name__ == "__main__":
    main()
