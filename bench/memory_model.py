"""The memory model against XLA: modeled peak per device beside the compiled one.

For the GPT training steps of ``bench/compare.py`` (``--cases``, default the 2-layer
step on mesh 8, 2 x 4 and 4 x 2), every plan of ``compare.limited_hand_plans`` (the
case's Megatron marks, DP, ZeRO-1, FSDP, tp+FSDP on a 2-D mesh) and ``mode="auto"``'s
plans (no limit, then ``--limits`` fractions of that plan's modeled peak). Per
(case, plan) it prints:

- modeled: ``passes/auto/memory.py``'s ``plan_peak`` of the plan's strategies (a hand
  plan: the graph after binding and propagation; an auto plan: ``plan.cost.peak_memory``,
  the search's own figure);
- compiled: the compiled step's ``memory_analysis()`` (``bench.hlo.peak_memory``:
  arguments + outputs + temp - aliased), per device;
- their ratio (goal 0.85-1.15), and for auto under a limit whether the compiled
  peak is under the limit;
- with ``--xla-live``: XLA's own live peak (the most bytes its buffers hold at one
  point of its schedule, read from the dumped ``live-range`` file) and the packing
  (compiled / live peak: what XLA's buffer assignment loses to fragmentation, which
  no count of live bytes sees).

    python bench/memory_model.py                                  # the 2-layer steps, 3 meshes
    python bench/memory_model.py --cases gpt2_train_dp4xmp2 --plans DP marks --limits ""
    python bench/memory_model.py --peak gpt2_train_dp2xmp4:DP    # what is alive at the modeled peak
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
DUMP = None
if __name__ == "__main__" and "--xla-live" in sys.argv:     # (XLA reads its flags once, at start)
    DUMP = tempfile.mkdtemp(prefix="memory_model_")
    import atexit
    import shutil
    atexit.register(shutil.rmtree, DUMP, True)
    os.environ["XLA_FLAGS"] += f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_body"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

from bench import zoo  # noqa: E402
from bench.compare import fresh, limited_hand_plans  # noqa: E402
from bench.hlo import peak_memory  # noqa: E402
import shardprop as sp  # noqa: E402
from shardprop.compiler.pipeline import default_passes  # noqa: E402
from shardprop.passes.auto.memory import largest_at_peak, plan_peak  # noqa: E402

CASES = ["gpt2_train_mp8", "gpt2_train_dp2xmp4", "gpt2_train_dp4xmp2"]
MiB = 2 ** 20


def xla_live_peak():
    """XLA's live peak of the program compiled last (its dumped live-range file), or None."""
    if DUMP is None:
        return None
    files = sorted(glob.glob(f"{DUMP}/*jit_body*live-range.txt"), key=os.path.getmtime)
    if not files:
        return None
    m = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", Path(files[-1]).read_text())
    for f in files:
        os.remove(f)
    return int(m.group(1).replace(" ", "")) if m else None


def compiled_peak(pf, args) -> tuple:
    """(compiled peak per device, XLA's live peak or None)."""
    xla_live_peak()     # (drops older dumps)
    return peak_memory(pf.lower(*args).compile()), xla_live_peak()


def mesh_of(case) -> Mesh:
    shape, names = case.mesh
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def planned_graph(pf, args):
    """The graph with every op's strategy and every argument's layout chosen (after
    binding and propagation or the search), before the redistributions are written."""
    graph, _ = pf._trace(args, {})
    bind, choose = default_passes(pf.options)[:2]
    return choose(bind(graph))


def hand_row(case, mesh, name, mode, kw, args) -> dict:
    """A hand plan's modeled peak (its own graph) and its compiled peak."""
    zoo.annotate.mode, zoo.annotate.mesh = mode, mesh
    pf = sp.parallelize(fresh(case.fn), mesh=mesh, donate_argnums=case.state_argnums, progress=False, **kw)
    g = planned_graph(pf, args)
    ops = {op: op.strategy for op in g.ops}
    inputs = {i: v.layout for i, v in enumerate(g.inputs)}
    compiled, live = compiled_peak(pf, args)
    return dict(plan=name, modeled=plan_peak(g, ops, inputs), compiled=compiled, live=live,
                largest=largest_at_peak(g, ops, inputs, 8))


def auto_row(case, mesh, name, args, cost_model, limit=None) -> dict:
    zoo.annotate.mode = "plain"
    pf = sp.parallelize(fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums, progress=False,
                        cost_model=cost_model, memory_limit=limit)
    t0 = time.perf_counter()
    try:
        plan = pf.plan(*args)
    except sp.ShardingError as e:
        # each round's modeled and compiled peak (memory_check.does_not_fit's words), else the message's start
        rounds = re.findall(r"round (\d+): searched under modeled limit ([\d.]+) MB: (?:no plan|modeled peak "
                            r"([\d.]+) MB, compiled ([\d.]+) MB)", str(e))
        said = "; ".join(f"round {k}: limit {m} MB, " + (f"modeled {p} MB, compiled {c} MB" if p else "no plan")
                         for k, m, p, c in rounds)
        return dict(plan=name, error=said or str(e).splitlines()[0][:160], limit=limit)
    seconds = time.perf_counter() - t0
    compiled, live = compiled_peak(pf, args)
    return dict(plan=name, modeled=plan.cost.peak_memory, compiled=compiled, live=live, limit=limit, seconds=seconds)


def run(case, plans, fracs, cost_model) -> list:
    mesh = mesh_of(case)
    host = jax.tree_util.tree_map(np.array, case.args())

    def args():
        return jax.tree_util.tree_map(np.array, host)       # donated state is deleted: a copy per plan
    rows = []
    hands = limited_hand_plans(case)
    for name in plans:
        if name in hands:
            mode, kw = hands[name]
            rows.append(hand_row(case, mesh, name, mode, kw, args()))
            report(case, rows[-1])
    if "auto" in plans:
        free = auto_row(case, mesh, "auto", args(), cost_model)
        rows.append(free)
        report(case, free)
        for f in fracs:
            rows.append(auto_row(case, mesh, f"auto {f}", args(), cost_model, int(f * free["modeled"])))
            report(case, rows[-1])
    return rows


def report(case, r) -> None:
    if "error" in r:
        print(f"{case.name:20} {r['plan']:9} failed: {r['error']}", flush=True)
        return
    under = "" if r.get("limit") is None else \
        f"  compiled/limit {r['compiled'] / r['limit']:.2f} ({'under' if r['compiled'] <= r['limit'] else 'OVER'})"
    took = f"  plan() {r['seconds']:.1f} s" if "seconds" in r else ""
    live = "" if r.get("live") is None else \
        f"  XLA live {r['live'] / MiB:.3f} (modeled/live {r['modeled'] / r['live']:.3f}, packing {r['compiled'] / r['live']:.3f})"
    print(f"{case.name:20} {r['plan']:9} {r['modeled'] / MiB:8.3f} {r['compiled'] / MiB:8.3f} "
          f"{r['modeled'] / r['compiled']:6.3f}{under}{took}{live}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=CASES)
    ap.add_argument("--plans", nargs="*", default=["marks", "DP", "ZeRO-1", "FSDP", "tp+FSDP", "auto"])
    ap.add_argument("--limits", default="0.5,0.7,0.9", help="auto's limits, fractions of its free plan's modeled peak")
    ap.add_argument("--cost-model", default="cpu")
    ap.add_argument("--xla-live", action="store_true", help="also XLA's live peak and its packing (dumps each "
                    "compiled program to a temporary folder)")
    ap.add_argument("--peak", metavar="CASE:PLAN", help="instead: the largest values alive at a hand plan's "
                    "modeled peak")
    a = ap.parse_args()
    fracs = [float(f) for f in a.limits.split(",") if f]
    by_name = {c.name: c for c in zoo.cases() + zoo.limit_cases()}
    if a.peak:
        name, plan = a.peak.split(":")
        case = by_name[name]
        mode, kw = limited_hand_plans(case)[plan]
        r = hand_row(case, mesh_of(case), plan, mode, kw, jax.tree_util.tree_map(np.array, case.args()))
        report(case, r)
        for n, shape, b in r["largest"]:
            print(f"  {b / MiB:8.3f} MiB  {n} {shape}")
        return
    print(f"{'case':20} {'plan':9} {'modeled':>8} {'compiled':>8} {'ratio':>6}   (MiB per device; ratio: "
          "modeled / compiled)", flush=True)
    for name in a.cases:
        run(by_name[name], a.plans, fracs, a.cost_model)


if __name__ == "__main__":
    main()
