"""Check a built-in GPU profile against the GPU jax sees (one GPU is enough).

The cluster planner (``sp.plan_step``, ``shardprop plan``) prices steps from a GPU
profile of datasheet figures and published GEMM measurements (``passes/profiles``).
This script measures the same quantities on the GPU in hand and prints them beside the
profile's prediction, so the profile is checked by a run, never fitted to it:

1. **bf16 matmuls by size**: a chain of ``[m, n] @ [n, n]`` products in one program
   (so launch gaps are the GPU's, not Python's), seconds per product against
   ``GpuProfile.matmul_time`` (peak x the efficiency curve, never under a launch);
2. **a float32 matmul** at jax's default precision against the fp32 matmul peak;
3. **HBM streaming**: ``x * a + b`` over 1 GiB of float32 (read once, written once)
   against ``GpuProfile.streaming_bytes_per_s``;
4. **a GPT training step** (``examples/gpt_plan.py``: bf16 compute, fp32 master
   weights, Adam) jitted on one GPU, its median step against ``sp.plan_step``'s modeled
   step on a one-GPU ``sp.Cluster`` of the profile, with and without recomputation;
   with ``--parts`` also its forward and its forward + backward alone.

Every time is the median of ``--reps`` runs after a warm-up.

    python bench/gpu_profile.py                      # the profile named after the device
    python bench/gpu_profile.py --profile h100-80gb
    python bench/gpu_profile.py --small              # tiny sizes: checks the script on a CPU
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardprop as sp  # noqa: E402
from shardprop.passes.cluster import GPUS, GpuProfile  # noqa: E402


def profile_for(device) -> str:
    """The built-in profile whose name matches the device's kind (H200 before H100)."""
    kind = device.device_kind.lower()
    for name in sorted(GPUS, reverse=True):
        if name.split("-")[0] in kind:
            return name
    return "h100-80gb"


def median_seconds(fn, args, reps: int, feed_back: bool = False) -> float:
    """Median seconds of ``fn(*args)`` after a warm-up; with ``feed_back``, a training
    step's new state (its first two results) is fed back as its first two arguments."""
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        if feed_back:
            args = (out[0], out[1]) + tuple(args[2:])
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rows(gpu: GpuProfile, shapes, chain: int, reps: int, dtype, peak: float) -> list:
    rows = []
    key = jax.random.key(0)
    for m, n in shapes:
        x = jax.random.normal(key, (m, n), jnp.float32).astype(dtype)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32) / n ** 0.5).astype(dtype)

        @jax.jit
        def chained(x, w):
            for _ in range(chain):
                x = x @ w
            return x
        t = median_seconds(chained, (x, w), reps) / chain
        flops = 2.0 * m * n * n
        rows.append((f"{jnp.dtype(dtype).name} [{m},{n}]@[{n},{n}]", flops, t, gpu.matmul_time(flops, peak)))
    return rows


def streaming_row(gpu: GpuProfile, elements: int, reps: int) -> tuple:
    x = jnp.ones((elements,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001 + 0.5)
    t = median_seconds(f, (x,), reps)
    return 8.0 * elements / t, gpu.streaming_bytes_per_s


def gpt_rows(gpu: GpuProfile, configs, reps: int, parts: bool) -> list:
    """Per config: the training step measured and modeled; with ``parts`` also its
    forward (the loss) and forward + backward (``value_and_grad``), so the gap can be
    placed."""
    import gpt_plan
    import optax
    rows = []
    mesh = ((1, 1), ("dp", "mp"))
    cluster = sp.Cluster(1, 1, gpu)
    for cfg in configs:
        step, args = gpt_plan.train_step_and_args(cfg)
        key = jax.random.key(1)
        leaves, tree = jax.tree_util.tree_flatten(args[0])
        params = jax.tree_util.tree_unflatten(tree, [0.02 * jax.random.normal(jax.random.fold_in(key, i), s.shape, s.dtype)
                                                     for i, s in enumerate(leaves)])
        tokens = jax.random.randint(key, (cfg.batch, cfg.seq), 0, cfg.vocab, jnp.int32)
        label = (f"GPT L{cfg.layers} h{cfg.hidden} s{cfg.seq} b{cfg.batch} {cfg.compute_dtype}"
                 f"{' remat' if cfg.remat else ''}")
        loss = functools.partial(gpt_plan.loss_fn, cfg=cfg)
        pieces = []
        if parts:
            pieces += [("forward", loss, (args[0], args[2], args[3]), (params, tokens, tokens)),
                       ("forward+backward", jax.value_and_grad(loss), (args[0], args[2], args[3]),
                        (params, tokens, tokens))]
        pieces.append(("step", step, args, None))
        for part, fn, abstract, real in pieces:
            is_step = real is None
            est = sp.plan_step(fn, abstract, mesh=mesh, cost_model=cluster, tokens=cfg.batch * cfg.seq,
                               **({} if is_step else dict(param_argnums=(), optimizer_argnums=())))
            if is_step:
                real = (params, optax.adam(1e-4).init(params), tokens, tokens)
                t = median_seconds(jax.jit(fn, donate_argnums=(0, 1)), real, reps, feed_back=True)
                params = None          # donated
            else:
                t = median_seconds(jax.jit(fn), real, reps)
            rows.append((f"{label} {part}", est.flops, t, est.step_s))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="a built-in GPU profile (default: the one named after the device)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="tiny sizes (checks the script anywhere)")
    ap.add_argument("--skip-gpt", action="store_true")
    ap.add_argument("--parts", action="store_true", help="also the GPT's forward and forward+backward alone")
    a = ap.parse_args(argv)
    dev = jax.devices()[0]
    name = a.profile or profile_for(dev)
    gpu = GpuProfile.builtin(name)
    print(f"jax {jax.__version__}, {dev.platform} device {dev.device_kind!r}; profile {name} ({gpu.device_kind})")
    if a.small:
        shapes, chain, elements = ((64, 64), (128, 128)), 2, 1 << 16
        gpts = [sp_gpt(layers=1, hidden=64, heads=4, seq=32, vocab=128, batch=2, remat=r) for r in (False, True)]
    else:
        shapes = ((512, 512), (1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (16384, 8192))
        chain, elements = 16, 1 << 28
        gpts = [sp_gpt(layers=4, hidden=2048, heads=16, seq=2048, vocab=51200, batch=8, remat=r)
                for r in (False, True)]
    rows = matmul_rows(gpu, shapes, chain, a.reps, jnp.bfloat16, gpu.matmul_flops_per_s)
    rows += matmul_rows(gpu, shapes[-3:-2], chain, a.reps, jnp.float32, gpu.fp32_matmul_flops_per_s)
    print(f"\n{'matmul':34} {'GFLOP':>9} {'measured':>10} {'TFLOP/s':>8} {'profile':>10} {'TFLOP/s':>8} "
          f"{'measured/profile':>17}")
    for label, flops, t, model in rows:
        print(f"{label:34} {flops / 1e9:9.2f} {t * 1e3:8.3f}ms {flops / t / 1e12:8.1f} {model * 1e3:8.3f}ms "
              f"{flops / model / 1e12:8.1f} {t / model:17.2f}")
    got, model = streaming_row(gpu, elements, a.reps)
    print(f"\nHBM streaming (x*a+b, {elements * 4 / 2**30:.2f} GiB float32): measured {got / 1e12:.2f} TB/s, "
          f"profile {model / 1e12:.2f} TB/s, measured/profile {got / model:.2f}")
    if not a.skip_gpt:
        print(f"\n{'one GPU (training step: Adam)':54} {'TFLOP':>7} {'measured':>10} {'model':>10} "
              f"{'measured/model':>15} {'MFU measured':>13}")
        for label, flops, t, model in gpt_rows(gpu, gpts, a.reps, a.parts):
            print(f"{label:54} {flops / 1e12:7.2f} {t * 1e3:8.2f}ms {model * 1e3:8.2f}ms {t / model:15.2f} "
                  f"{flops / t / gpu.matmul_flops_per_s:13.3f}")
    return 0


def sp_gpt(**kw):
    import gpt_plan
    return gpt_plan.GPT(compute_dtype="bfloat16", **kw)


if __name__ == "__main__":
    sys.exit(main())
