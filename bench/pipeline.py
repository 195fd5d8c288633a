"""Pipeline parallelism on 8 forced CPU devices: step time, compiled memory, bubbles.

An MLP training step (Adam) with a ``stage_boundary`` after every ``layers / (pp*v)``
layers, run on one device and pipelined on ``pp`` ranks with each schedule. Per
schedule it prints:

- the measured step time (median of ``--steps``) and its ratio to the one-device step
  (the sum of the stages' work: forced CPU devices share this machine's cores, so a rank
  that idles frees a core and wall-clock idle time is not the bubble);
- the modeled step time on this machine: the lowering's tick table with F = 1, B = 2
  units (I = W = 1), a unit being the one-device step over ``3 * m * S`` (S model
  stages), each tick costing its slowest action times ``max(1, busy ranks / cores)``;
- the compiled program's temp bytes (``memory_analysis()``: activation stashes) and its
  activation slots per rank (GPipe keeps ``m``, 1F1B about ``p``);
- the unit-cost bubble (simulator, F = 1, B = 2) and whether a bubble tick computes
  nothing (the no-op branch of the compiled tick loop only moves buffers).

    python bench/pipeline.py                        # width 512, 8 layers, batch 64, pp 4, m 8
    python bench/pipeline.py --pp 8 --microbatches 16 --out bench/results/pipeline.txt
"""
import argparse
import os
import statistics
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardprop as sp  # noqa: E402
from shardprop.runtime.pipeline_lower import bubble_computes_nothing  # noqa: E402


def make(width, layers, batch, stages):
    opt = optax.adam(1e-3)
    per = layers // stages

    def loss_fn(params, x, y):
        h = x
        for i, w in enumerate(params):
            h = jnp.tanh(h @ w)
            if (i + 1) % per == 0 and i + 1 < layers:
                h = sp.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        up, state = opt.update(g, state, params)
        return optax.apply_updates(params, up), state, loss

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.standard_normal((batch, width)).astype(np.float32)
    return step, params, opt.init(params), x, y


def timed(fn, args, steps):
    p, s, x, y = args
    p, s, loss = fn(p, s, x, y)          # compile and warm up
    jax.block_until_ready(loss)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        p, s, loss = fn(p, s, x, y)
        jax.block_until_ready(loss)
        jax.block_until_ready(jax.tree.leaves(p)[0].buffer if hasattr(jax.tree.leaves(p)[0], "buffer")
                              else jax.tree.leaves(p)[0])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def modeled(sim, t_single, m, S, cores):
    unit = t_single / (3 * m * S)
    dur = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}
    per_tick = {}
    for (t, d), a in sim.tick_table.items():
        per_tick.setdefault(t, []).append(dur[a.kind])
    return sum(max(v) * max(1.0, len(v) / cores) for v in per_tick.values()) * unit


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zero_bubble", "interleaved"])
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    lines = [f"pipeline bench: MLP width {a.width}, {a.layers} layers, batch {a.batch}, pp={a.pp}, "
             f"m={a.microbatches}, {a.steps} steps (median), {cores} cores, jax {jax.__version__}"]
    step, params, state, x, y = make(a.width, a.layers, a.batch, 1)
    t_single = timed(jax.jit(step), (params, state, x, y), a.steps)
    lines.append(f"one device: {t_single * 1e3:.1f} ms")
    lines.append(f"{'schedule':<14}{'ms':>8}{'/1dev':>7}{'model ms':>10}{'meas/model':>11}{'temp KiB':>10}"
                 f"{'slots':>6}{'ticks':>6}{'bubble':>8}  bubble-computes-nothing")
    for name in a.schedules:
        v = 2 if name == "interleaved" else 1
        S = a.pp * v
        if a.layers % S:
            lines.append(f"{name:<14} skipped: {a.layers} layers do not split into {S} model stages")
            continue
        step, params, state, x, y = make(a.width, a.layers, a.batch, S)
        pstep = sp.parallelize(step, mesh=((a.pp,), ("pp",)), batch_argnums=(2, 3),
                               pipeline=sp.Pipeline(microbatches=a.microbatches, schedule=name, virtual_stages=v))
        plan = pstep.plan(params, state, x, y)
        compiled = pstep.compiled(params, state, x, y)
        mem = compiled.memory_analysis()
        empty = bubble_computes_nothing(compiled.as_text())
        t = timed(pstep, (params, state, x, y), a.steps)
        model = modeled(plan.pipeline.sim, t_single, a.microbatches, S, cores)
        lines.append(f"{name:<14}{t * 1e3:8.1f}{t / t_single:7.2f}{model * 1e3:10.1f}{t / model:11.2f}"
                     f"{mem.temp_size_in_bytes / 1024:10.0f}{plan.pipeline.slots:6d}{plan.pipeline.ticks:6d}"
                     f"{plan.pipeline.unit_bubble:8.3f}  {empty}")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
