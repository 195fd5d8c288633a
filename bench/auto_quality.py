"""How far ``mode="auto"``'s plan is from the optimum of the exact, un-coarsened ILP.

The search solves a coarsened problem (followers, layers sharing variables) and
refines its plan; the exact ILP gives every op its own decision (``follow=False,
share_layers=False``). What is measured is the coarse search alone (``exact_ops=0``):
``mode="auto"`` also solves a graph of up to ``search.EXACT_OPS`` ops, these steps
included, without coarsening and keeps the better plan; the coarsening is what plans
graphs larger than that. Both are priced op by op by the same ``Problem.evaluate``
under the default cost model. Per MLP training step (SGD or Adam; ReLU layers of
width x width on a batch x width input, mean squared error) and 2-axis mesh, prints
searched / exact modeled step time, then how many steps are equal, within 1%, and
the worst ratio.

    python bench/auto_quality.py                                   # 72 steps, about 30 s
    python bench/auto_quality.py --steps adam --layers 2 --meshes 4x2
"""
import argparse
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optax  # noqa: E402

from shardprop.ir.mesh import Mesh  # noqa: E402
from shardprop.passes.auto import SearchStrategies, milp  # noqa: E402
from shardprop.passes.auto.problem import Problem  # noqa: E402
from shardprop.passes.cost import DEFAULT_COST  # noqa: E402
from tests.test_auto import adam_step, problem_data, sgd_step, traced_graph  # noqa: E402

SIZES = ["512x128", "2048x256", "2048x512", "8192x512", "1024x1024", "256x2048"]   # batch x width


def step_graph(step: str, batch: int, width: int, layers: int, mesh: Mesh):
    params, x, y = problem_data(batch, width, layers)
    if step == "adam":
        return traced_graph(adam_step, (params, optax.adam(1e-3).init(params), x, y), mesh, tied=(0, 1))
    return traced_graph(sgd_step, (params, x, y), mesh, tied=(0,))


def ratio(graph) -> float:
    exact = Problem(graph, DEFAULT_COST, follow=False, share_layers=False)
    e = exact.evaluate(*exact.op_strategies(milp.solve(milp.reduce(exact, False)).choice))
    # the coarse search alone: mode="auto" also solves graphs this small without coarsening
    # (search.EXACT_OPS), which would make every ratio 1
    _, searched, _ = SearchStrategies(exact_ops=0).search(graph)
    s = exact.evaluate(*searched.plan)
    return (s["compute"] + s["communication"]) / (e["compute"] + e["communication"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", nargs="+", default=["adam", "sgd"], choices=["adam", "sgd"])
    ap.add_argument("--sizes", nargs="+", default=SIZES, help="batch x width")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--meshes", nargs="+", default=["2x4", "4x2"])
    a = ap.parse_args()
    ratios = []
    print(f"{'step':<5} {'batch x width':>13} {'layers':>6} {'mesh':>5} {'searched / exact':>17}")
    for step in a.steps:
        for size in a.sizes:
            batch, width = (int(t) for t in size.split("x"))
            for layers in a.layers:
                for m in a.meshes:
                    mesh = Mesh(("a", "b"), tuple(int(t) for t in m.split("x")))
                    r = ratio(step_graph(step, batch, width, layers, mesh))
                    ratios.append(r)
                    print(f"{step:<5} {size:>13} {layers:>6} {m:>5} {r:>17.4f}", flush=True)
    equal = sum(r < 1 + 1e-4 for r in ratios)
    within = sum(r <= 1.01 for r in ratios)
    print(f"\n{len(ratios)} steps: equal to the exact ILP {equal}, within 1% {within}, worst {max(ratios):.4f}")


if __name__ == "__main__":
    main()
