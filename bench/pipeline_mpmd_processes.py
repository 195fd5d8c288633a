"""The MPMD pipeline lowering against the SPMD one, in one process or over several.

bench/pipeline.py's MLP training step (Adam, a ``stage_boundary`` after every
``layers / pp`` layers) pipelined on ``pp`` ranks, once per lowering, in the same
processes; the two steps are timed round-robin (``--reps`` rounds of ``--steps`` steps
each, every step fed its own outputs), and the medians printed by process 0, wall-clock
and this process's CPU time (``time.process_time``) per step, with their ratio.
Started by the launcher, every process runs it and the mesh spans them:

    shardprop launch --nproc 2 --devices-per-proc 2 bench/pipeline_mpmd_processes.py --pp 4
    python bench/pipeline_mpmd_processes.py --pp 4            # one process, pp forced CPU devices

A round ends when every process has its step's outputs (each process blocks on the
arrays it holds, then all meet at a barrier), so a lowering's last transfers and
optimizer steps are inside its time.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import add_model_args, make   # noqa: E402  (bench/pipeline.py's model)

import shardprop as sp   # noqa: E402
from shardprop.runtime.distributed import in_multiprocess_environment, use_cpu_devices  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--lowerings", nargs="+", default=["spmd", "mpmd"], choices=["spmd", "mpmd"])
    a = ap.parse_args(argv)
    if not in_multiprocess_environment():
        use_cpu_devices(a.pp)
    import jax
    from jax.experimental import multihost_utils

    step, params, state, x, y = make(a.width, a.layers, a.batch, a.pp)
    runs = {}
    for lowering in a.lowerings:
        pstep = sp.parallelize(step, mesh=((a.pp,), ("pp",)), batch_argnums=(2, 3),
                               pipeline=sp.Pipeline(microbatches=a.microbatches, schedule=a.schedule,
                                                    lowering=lowering))
        runs[lowering] = [pstep, (params, state, x, y)]

    def local(tree):
        return [getattr(leaf, "buffer", leaf) for leaf in jax.tree.leaves(tree)]

    def steps(lowering, n):
        pstep, args = runs[lowering]
        for _ in range(n):
            p, s, loss = pstep(*args)
            args = (p, s) + args[2:]
        runs[lowering][1] = args
        jax.block_until_ready(local((p, s, loss)))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("pipeline_mpmd_processes step")
        return loss

    losses = {lw: float(sp.to_numpy(steps(lw, 2))) for lw in runs}          # compile, warm up
    times = {lw: ([], []) for lw in runs}
    for _ in range(a.reps):
        for lw in runs:
            w0, c0 = time.perf_counter(), time.process_time()
            steps(lw, a.steps)
            times[lw][0].append((time.perf_counter() - w0) / a.steps)
            times[lw][1].append((time.process_time() - c0) / a.steps)
    med = {lw: (statistics.median(w), statistics.median(c)) for lw, (w, c) in times.items()}
    sp.print0(f"{jax.process_count()} process(es), {jax.device_count()} devices, pp={a.pp} {a.schedule}, "
              f"m={a.microbatches}, width {a.width}, {a.layers} layers, batch {a.batch}; medians of {a.reps} "
              f"interleaved rounds of {a.steps} steps")
    for lw, (w, c) in med.items():
        sp.print0(f"  {lw:5s} step {w * 1e3:8.1f} ms wall  {c * 1e3:8.1f} ms CPU (process 0)   "
                  f"loss after warm-up {losses[lw]:.6f}")
    if len(med) == 2:
        sp.print0(f"  mpmd / spmd: {med['mpmd'][0] / med['spmd'][0]:.2f} wall, "
                  f"{med['mpmd'][1] / med['spmd'][1]:.2f} CPU")


if __name__ == "__main__":
    main()
