"""Pipelines composed (issue 26), on 8 forced CPU devices: three figures.

1. **tied gradients between the owners**: the tied-embedding GPT of
   ``examples/gpt_pipeline.py`` on ``pp=4 x mp=2``; the compiled program's collectives
   that cross pipeline ranks (kind, elements, devices per group), with the tied gradients
   sent between the owner ranks (``runtime/pipeline_lower.py`` ``_share``) and, for
   comparison, with the masked ``psum`` over every pipeline rank that it replaced (forced
   by leaving ``share_targets`` empty); and the step time of both (median of ``--reps``
   interleaved repetitions);
2. **mode="auto" on a mesh with a pp axis**: what the searches chose (micro-batches,
   schedule, which weights the strategy search split over ``mp``), the planning seconds,
   and the largest differences to one device after ``--steps`` Adam steps;
3. **modeled bytes against the compiled program**: per schedule and micro-batch count,
   a pipeline plan's modeled bytes per device (``plan.pipeline.memory``: the state row,
   the accumulator, the activation slots, the per-micro-batch outputs) beside XLA's
   ``memory_analysis()`` of the compiled step (arguments + outputs + temporaries -
   aliased, per device), on an MLP of ``--width`` on ``pp=4`` at 64 rows (the state
   dominates) and of half the width at 1024 rows (the activations do).

    python bench/pipeline_compose.py                 # width 256, 5 repetitions, 3 steps
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import gpt_pipeline  # noqa: E402

import shardprop as sp  # noqa: E402
from shardprop.compiler.pipeline_step import unpack  # noqa: E402
from shardprop.runtime.pipeline_lower import PipelineProgram, collectives_across_pipeline  # noqa: E402
sys.path.insert(0, str(ROOT))
from bench.hlo import peak_memory  # noqa: E402
from tests.test_pipeline_auto_mesh import LR, mlp  # noqa: E402

def crossing_pp(hlo: str, mp: int) -> list:
    """``(kind, elements, devices per group)`` of the collectives that span pipeline ranks
    in compiled HLO of a ``((p, mp), ("pp", "mp"))`` mesh."""
    return [(kind, elems, len(groups[0]) if kind != "collective-permute" else 2)
            for kind, elems, groups in collectives_across_pipeline(hlo, mp)]


def tied_exchange(reps: int) -> None:
    cfg = gpt_pipeline.Config(layers=4, batch=16, vocab=512, seq=16, heads=4, head_dim=16)
    params = gpt_pipeline.init_pipeline_params(cfg, tied=True)
    step, opt = gpt_pipeline.make_train_step(cfg, 4, tp=gpt_pipeline.tensor_parallel())
    state = opt.init(params)
    data = tuple(gpt_pipeline.make_batch(cfg))
    print(f"== 1. tied embedding ({cfg.vocab} x {cfg.heads * cfg.head_dim}) on pp=4 x mp=2, 1f1b, m=4")
    keep = PipelineProgram._plan_share_targets
    runs = {}
    for name in ("owners", "psum over pp"):
        if name != "owners":
            PipelineProgram._plan_share_targets = lambda self, needed, users: None
        try:
            pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "mp")), batch_argnums=(2, 3),
                                   pipeline=sp.Pipeline(microbatches=4, schedule="1f1b"))
            pstep(params, state, *data)          # compiled with the lowering of this run
            hlo = pstep.lower_text(params, state, *data)
        finally:
            PipelineProgram._plan_share_targets = keep
        big = [c for c in crossing_pp(hlo, 2) if c[1] > 1024]
        print(f"   {name}: collectives crossing pp over 1024 elements: {big}")
        runs[name] = pstep
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, pstep in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(jax.tree.leaves(pstep(params, state, *data)))
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"   {name}: step median {statistics.median(ts) * 1e3:.1f} ms over {reps}")


def auto_mode(steps: int, width: int) -> None:
    print(f"== 2. mode='auto' on ((4, 2), ('pp', 'mp')), Adam lr {LR}, {steps} steps against one device")
    cases = [("stage marks, no shard mark, no pipeline=", mlp(4, width, 16, stages=4), {}),
             ("stage marks, no shard mark, no pipeline=", mlp(8, width, 32, stages=4), {}),
             ("no mark at all, no pipeline=", mlp(8, width // 4, 32, stages=0), {}),
             ("stage marks, pipeline=Pipeline(4, '1f1b')", mlp(8, width, 32, stages=4),
              dict(pipeline=sp.Pipeline(microbatches=4, schedule="1f1b")))]
    for name, (step, params, state, data), kw in cases:
        t = time.perf_counter()
        pstep = sp.parallelize(step, mesh=((4, 2), ("pp", "mp")), mode="auto", batch_argnums=(2, 3), **kw)
        plan = pstep.plan(params, state, *data)
        planning = time.perf_counter() - t
        dims = [plan.program.sub.in_dims[i] for i in range(2 * len(params))]
        split = sum(1 for d in dims if any(d))
        ref = jax.jit(step)
        p1, o1, p2, o2 = params, state, params, state
        loss_rel = 0.0
        for _ in range(steps):
            p1, o1, l1 = ref(p1, o1, *data)
            p2, o2, l2 = pstep(p2, o2, *data)
            loss_rel = max(loss_rel, abs(float(l2) - float(l1)) / abs(float(l1)))
        dp = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                 for a, b in zip(jax.tree.leaves(unpack(p2)), jax.tree.leaves(p1)))
        print(f"   {name} ({len(params)} layers, width {params[0][0].shape[0]}, batch {data[0].shape[0]}): "
              f"m={plan.pipeline.microbatches} "
              f"{plan.pipeline.schedule_name}, {split} of {len(dims)} weights split over mp, planned in "
              f"{planning:.1f} s; loss rel diff {loss_rel:.1e}, param max abs diff {dp:.1e} ({dp / LR:.3f} lr)")


def memory(width: int, batch: int) -> None:
    print(f"== 3. modeled bytes per device against memory_analysis(), MLP width {width}, 8 layers, batch {batch}, "
          "pp=4")
    step, params, state, data = mlp(8, width, batch, stages=4)
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            pstep = sp.parallelize(step, mesh=((4,), ("pp",)), batch_argnums=(2, 3),
                                   pipeline=sp.Pipeline(microbatches=m, schedule=schedule))
            plan = pstep.plan(params, state, *data)
            program = pstep.compiled(params, state, *data)
            ma, compiled = program.memory_analysis(), peak_memory(program)
            print(f"   {schedule:5s} m={m}: modeled {plan.pipeline.memory / 2**20:7.2f} MiB, compiled "
                  f"{compiled / 2**20:7.2f} MiB (arguments {ma.argument_size_in_bytes / 2**20:.2f}, outputs "
                  f"{ma.output_size_in_bytes / 2**20:.2f}, temp {ma.temp_size_in_bytes / 2**20:.2f}); "
                  f"modeled / compiled {plan.pipeline.memory / compiled:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", choices=("tied", "auto", "memory"))
    a = ap.parse_args()
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices")
    if a.only in (None, "tied"):
        tied_exchange(a.reps)
    if a.only in (None, "auto"):
        auto_mode(a.steps, a.width)
    if a.only in (None, "memory"):
        memory(a.width, 64)            # the state dominates
        memory(a.width // 2, 1024)     # the activations dominate


if __name__ == "__main__":
    main()
