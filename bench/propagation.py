"""How fast shardprop plans a GPT training step as the model grows.

Traces a GPT-style training step (forward, backward, Adam; Megatron annotations,
8-way tensor parallel) at several depths and prints, per size: jaxpr equations,
seconds in jax's tracing, in our import and in each pass, and microseconds per
equation for our pipeline (import + passes), as medians over rounds in which the
sizes take turns. Flat per-equation time means the pipeline is linear in graph
size; the growth ratios compare runs made side by side. Compiling runs with the
garbage collector paused, as ``parallelize`` does. Beside the wall-clock figure:
the CPU time of the planning thread per equation (what a busy shared host does not inflate as
much) and our time over jax's own tracing of the same step.

    python bench/propagation.py                 # 12, 24, 48, 96 layers
    python bench/propagation.py --layers 12 24 --repeat 3
"""
import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import jax  # noqa: E402
import jax.extend  # noqa: E402

import gpt_megatron as M  # noqa: E402
from shardprop.compiler.pipeline import Options, gc_paused, run_pipeline  # noqa: E402
from shardprop.compiler.state import state_ties  # noqa: E402
from shardprop.compiler.trace import import_jaxpr, input_names  # noqa: E402
from shardprop.runtime.mesh import resolve_mesh  # noqa: E402


def count_eqns(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_eqns(sub)
    return n


def measure(layers: int, mesh_spec) -> dict:
    cfg = M.Config(layers=layers)
    params = M.init_params(cfg)
    tokens, targets = M.make_batch(cfg)
    step, opt = M.make_train_step(M.Parallelism.tensor(8), cfg)
    state = opt.init(params)
    args = (params, state, tokens, targets)
    gc.collect()   # start each size with no garbage left by the one before
    t0 = time.perf_counter()
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*args)
    t1, c1 = time.perf_counter(), time.thread_time()
    with gc_paused():   # as parallelize() compiles
        graph = import_jaxpr(closed, mesh_spec.ir_mesh, input_names(step, args, {}), "train_step")
        graph.count_mesh = True
        graph.tied_outputs = state_ties(args, (0, 1), out_shape)   # donated, as the example runs it
        t2 = time.perf_counter()
        res = run_pipeline(graph, Options())
        ours, cpu = time.perf_counter() - t1, time.thread_time() - c1   # import + every pass
    graph = res.graph
    seconds = {"import": t2 - t1, **res.seconds}
    eqns = count_eqns(closed.jaxpr)
    collectives = sum(1 for _, op in graph.walk_ops() if op.kind == "all_reduce")
    return dict(layers=layers, eqns=eqns, trace=t1 - t0, seconds=seconds, total=ours,
                us_per_eqn=ours / eqns * 1e6, cpu_us_per_eqn=cpu / eqns * 1e6, all_reduces=collectives)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    ap.add_argument("--repeat", type=int, default=3, help="repetitions per size; the median is reported")
    args = ap.parse_args()
    mesh_spec = resolve_mesh(8)
    measure(min(args.layers), mesh_spec)   # warm up: first-call costs are not per equation
    # Sizes take turns, so a slow spell of this shared machine hits them all alike
    # and the growth ratios compare runs made side by side.
    runs: dict = {n: [] for n in args.layers}
    for _ in range(args.repeat):
        for n in args.layers:
            runs[n].append(measure(n, mesh_spec))
    rows = []
    for n in args.layers:
        med = sorted(runs[n], key=lambda r: r["total"])[len(runs[n]) // 2]
        rows.append(med)
        passes = "  ".join(f"{k} {v:.3f}s" for k, v in med["seconds"].items())
        print(f"{n:3d} layers  {med['eqns']:6d} eqns  jax trace {med['trace']:.2f}s  | {passes}  | "
              f"ours {med['total']:.2f}s = {med['us_per_eqn']:.0f} us/eqn (cpu {med['cpu_us_per_eqn']:.0f}), "
              f"{med['total'] / med['trace']:.2f}x jax's trace  ({med['all_reduces']} all_reduce)",
              flush=True)
    small = args.layers[0]
    print()
    print("per-equation time relative to the smallest model (median over the rounds of the ratio "
          "within each round): " + ", ".join(
              f"{n} layers {statistics.median(r['us_per_eqn'] / s['us_per_eqn'] for r, s in zip(runs[n], runs[small])):.2f}x"
              for n in args.layers))
    print(f"median of {args.repeat} runs per size; goal: <= 50 us/eqn and <= 1.2x growth")


if __name__ == "__main__":
    main()
