"""Layers written as a ``jax.lax.scan`` against the same layers unrolled, under ``mode="auto"``.

Researchers stack a model's layers and ``scan`` over them (flax's ``nn.scan``, MaxText)
so that the program, and its compile, do not grow with depth. The search plans a loop
as one decision with its summary rule and propagates its body with the boundary pinned
(docs/design/search.md, "Not done yet"), where an unrolled program gives it every
layer's ops. This bench measures what that costs.

The step: an MLP (``--layers`` matmuls of ``--width``, batch ``--batch``) or the GPT of
examples/gpt_megatron.py unmarked (``--model gpt``), trained by the example's Adam step.
Each is written twice with the same weights: scanned over stacked parameters, and
unrolled with one array per layer, as users write it. Each form is planned by
``mode="auto"`` (and under each ``--limits`` share of the unrolled free plan's modeled
peak) and by ``mode="data_parallel"`` with ZeRO-1 (a hand plan), the weights and Adam's
state donated, and jitted on one device.

Printed per plan: the modeled step, bytes moved, modeled peak, and whether its result
equals its form's one-device run: the new weights to one learning rate, as the project's
tests hold them (Adam's first step divides the gradient by its own size, so where a
gradient is near Adam's epsilon a rounding difference moves the weight by a share of
the learning rate; 0.17 of it was seen here), the rest to float32 rounding. Then the
measured step: interleaved medians of ``--repeat`` runs, every program in one round,
every call taking its inputs from host memory alike.

    python bench/scan_layers.py
    python bench/scan_layers.py --layers 8 --width 1024 --batch 64 --mesh 2x4
    python bench/scan_layers.py --model gpt --layers 4
"""
import argparse
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import zoo  # noqa: E402  (puts examples/ on the path)
from bench.compare import median_interleaved_all  # noqa: E402
import gpt_megatron as G  # noqa: E402
import shardprop as sp  # noqa: E402

LEARNING_RATE = 1e-3   # (adam_train_step's)
DONATED = (0, 1)   # the weights and Adam's state
MESHES = {"4x2": ((4, 2), ("dp", "mp")), "2x4": ((2, 4), ("dp", "mp"))}


def loss_scanned(ws, x, y):
    h, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, ws)
    return jnp.mean((h - y) ** 2)


def loss_unrolled(ws, x, y):   # (ws: one matrix per layer)
    h = x
    for w in ws:
        h = jax.nn.relu(h @ w)
    return jnp.mean((h - y) ** 2)


def adam(loss, params, *batch) -> tuple:
    """(the example's Adam training step of ``loss``, its inputs: the parameters, Adam's
    state, the batch). It returns the new parameters, the state (whose first moment holds
    the gradient) and the loss."""
    step, opt = G.adam_train_step(loss, LEARNING_RATE)
    return step, (params, jax.tree_util.tree_map(np.asarray, opt.init(params)), *batch)


def mlp_forms(args) -> dict:
    """form -> (its step, its inputs); and "title": what the title says. The same weights:
    stacked for the scan, one array per layer unrolled."""
    rng = np.random.default_rng(0)
    ws = (rng.standard_normal((args.layers, args.width, args.width)) * 0.05).astype(np.float32)
    x, y = (rng.standard_normal((args.batch, args.width)).astype(np.float32) for _ in range(2))
    return {"scan": adam(loss_scanned, ws, x, y), "unrolled": adam(loss_unrolled, list(ws), x, y),
            "title": f"MLP training step: {args.layers} layers of {args.width} x {args.width}, batch {args.batch}"}


def gpt_forms(args) -> dict:
    """The GPT of examples/gpt_megatron.py (the zoo's size: heads 8 x 16, seq 32, batch 8,
    vocab 256), unmarked: its blocks as a scan over the layers' parameters stacked, or one
    block per layer as the example writes it (the same parameters)."""
    zoo.annotate.mode = "plain"   # (no marks: the program mode="auto" plans)
    cfg = G.Config(layers=args.layers, batch=8, seq=32, heads=8, head_dim=16, vocab=256)
    par = G.Parallelism.data_and_tensor()

    def loss(scanned: bool):
        def block(x, p):
            return G.mlp(G.attention(x, p, par, cfg), p, par)

        def fn(params, tokens, targets):
            with zoo.marks_through_annotate(G):
                x = jax.nn.one_hot(tokens, cfg.vocab, dtype=jnp.float32) @ params["wte"] + params["wpe"]
                if scanned:
                    x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["layers"])
                else:
                    for p in params["layers"]:
                        x = block(x, p)
                x = G.layer_norm(x, params["lnf_g"], params["lnf_b"])
                logp = jax.nn.log_softmax(x @ params["wte"].T, axis=-1)
                return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, cfg.vocab) * logp, axis=-1))
        return fn
    params = G.init_params(cfg)
    stacked = dict(params, layers=jax.tree_util.tree_map(lambda *a: np.stack(a), *params["layers"]))
    tokens, targets = G.make_batch(cfg)
    return {"scan": adam(loss(True), stacked, tokens, targets), "unrolled": adam(loss(False), params, tokens, targets),
            "title": f"GPT training step (examples/gpt_megatron.py, unmarked): {args.layers} layers, heads 8 x 16, "
                     f"seq 32, batch 8, vocab 256"}


MODELS = {"mlp": mlp_forms, "gpt": gpt_forms}


def equal(got, want) -> bool:
    """The step's results against one device's: the new weights (the first output) to one
    learning rate, the rest to float32 rounding (slack scaled by the largest magnitude)."""
    for k, (got_part, want_part) in enumerate(zip(got, want)):
        for g, w in zip(jax.tree_util.tree_leaves(got_part), jax.tree_util.tree_leaves(want_part)):
            g, w = np.asarray(g), np.asarray(w)
            slack = LEARNING_RATE if k == 0 else 1e-5 * max(1.0, float(np.abs(w).max(initial=0.0)))
            if g.shape != w.shape or not np.allclose(g, w, rtol=1e-5, atol=slack):
                return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="mlp")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512, help="(mlp)")
    ap.add_argument("--batch", type=int, default=256, help="(mlp)")
    ap.add_argument("--mesh", choices=sorted(MESHES), default="4x2")
    ap.add_argument("--limits", type=float, nargs="*", default=[],
                    help="memory limits, as shares of the unrolled step's free modeled peak (its free plan is "
                         "at the least peak the model finds for these steps: Adam's update over the "
                         "weights, split over every device, holds a dozen of them)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    mesh = MESHES[args.mesh]
    forms = MODELS[args.model](args)
    title = forms.pop("title")
    step, data = forms["unrolled"]
    free_peak = sp.parallelize(step, mesh=mesh, mode="auto", progress=False, cost_model="cpu",
                               donate_argnums=DONATED).plan(*data).cost.peak_memory
    print(f"{title}, Adam, mesh {args.mesh}, cost model cpu; the unrolled step's free modeled peak "
          f"{free_peak / 1e6:.2f} MB")
    runs = []   # (label, callable)
    head = f"{'form':<9} {'plan':<22} {'modeled ms':>10} {'MB moved':>9} {'peak MB':>8} {'equal':>6}"
    print(head)
    for form, (step, data) in forms.items():
        want = jax.jit(step)(*data)
        plans = [("auto", dict(mode="auto")), ("data_parallel+ZeRO-1", dict(mode="data_parallel",
                                                                            shard_optimizer_state=True))]
        plans += [(f"auto at {share:g}", dict(mode="auto", memory_limit=int(share * free_peak)))
                  for share in args.limits]
        for label, kw in plans:
            pf = sp.parallelize(step, mesh=mesh, progress=False, cost_model="cpu", donate_argnums=DONATED, **kw)
            try:
                cost = pf.plan(*data).cost
                ok = equal(pf(*data), want)
            except sp.ShardingError as e:
                print(f"{form:<9} {label:<22} no plan: {str(e).splitlines()[0][:110]}")
                continue
            figures = "        (the search's figures only)" if cost is None else \
                f"{cost.step_time * 1e3:>10.3f} {cost.bytes_moved / 1e6:>9.3f} {cost.peak_memory / 1e6:>8.2f}"
            print(f"{form:<9} {label:<22} {figures} {str(ok):>6}", flush=True)
            runs.append((f"{form} {label}", lambda pf=pf, data=data: pf(*data)))
        runs.append((f"{form} one device (jit)", lambda f=jax.jit(step), data=data: f(*data)))
    seconds = median_interleaved_all([f for _, f in runs], args.repeat)
    print(f"\nmeasured step, median of {args.repeat} interleaved runs:")
    for (label, _), s in zip(runs, seconds):
        print(f"  {label:<32} {s * 1e3:8.2f} ms")
    by = dict(zip((label for label, _ in runs), seconds))
    if "scan auto" in by and "unrolled auto" in by:
        print(f"scan auto / unrolled auto: {by['scan auto'] / by['unrolled auto']:.3f}")


if __name__ == "__main__":
    main()
