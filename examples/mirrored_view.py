"""Two views of one model: global (OneFlow's consistent view) and mirrored.

The same Megatron-style MLP block, written twice:

- global view: the single-device code with one mark; ``parallelize`` derives the
  rest (the row-parallel second matmul, the all_reduce after it, the backward);
- mirrored view: per-device code in a ``jax.shard_map``, with the reduction written
  by hand (``lax.psum``), called inside the same parallelized function as ordinary
  code around it. Its in_specs/out_specs are fixed layouts the compiler plans
  around; its body runs as written, and the dumps show it per rank.

Both give one device's numbers, forward and gradients.

    python examples/mirrored_view.py
"""
import sys

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)   # any machine can run it (unless a launcher chose the devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardprop as sp  # noqa: E402

MESH = ((2, 4), ("dp", "mp"))   # batch over dp, the MLP's hidden dim over mp


def global_view(x, w1, w2):
    """One device's code, one mark: w1 column-parallel. The compiler does the rest."""
    h = sp.shard(jnp.matmul, (P("dp", None), P(None, "mp")))(x, w1)
    return jnp.tanh(x + jax.nn.gelu(h) @ w2)


def mlp_block(x, w1, w2):
    """Per-device code: this device's batch rows and its slice of the hidden units."""
    partial = jax.nn.gelu(x @ w1) @ w2      # this device's share of the output
    return lax.psum(partial, "mp")          # the reduction, written by hand


def mirrored_view(x, w1, w2):
    # mesh= is left out: the shard_map runs on the parallelize mesh
    y = jax.shard_map(mlp_block, in_specs=(P("dp", None), P(None, "mp"), P("mp", None)),
                      out_specs=P("dp", None))(x, w1, w2)
    return jnp.tanh(x + y)                  # ordinary code around it is planned as usual


def loss(view):
    return lambda x, w1, w2: jnp.mean(view(x, w1, w2) ** 2)


def main(dump_dir=None):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    w1 = (rng.standard_normal((64, 256)) / 8).astype(np.float32)
    w2 = (rng.standard_normal((256, 64)) / 16).astype(np.float32)

    # one device: the global view's code as it is (shard() marks compute what they wrap)
    y_ref = jax.jit(global_view)(x, w1, w2)
    g_ref = jax.jit(jax.grad(loss(global_view), argnums=(1, 2)))(x, w1, w2)
    results = {}
    for name, view in (("global", global_view), ("mirrored", mirrored_view)):
        y = sp.parallelize(view, mesh=MESH, dump_dir=dump_dir and f"{dump_dir}/{name}")(x, w1, w2)
        g = sp.parallelize(jax.grad(loss(view), argnums=(1, 2)), mesh=MESH)(x, w1, w2)
        err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip((y, *g), (y_ref, *g_ref)))
        results[name] = (y, g)
        plan = sp.parallelize(view, mesh=MESH).plan(x, w1, w2)
        inserted = ", ".join(c.kind for c in plan.collectives) or "none (the psum is the user's)"
        print(f"{name:>8} view: max |difference| from one device {err:.2e}; collectives inserted: {inserted}")
    agree = all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in
                zip(jax.tree_util.tree_leaves(results["global"]), jax.tree_util.tree_leaves(results["mirrored"])))
    print("global view and mirrored view agree" if agree else "global view and mirrored view DIFFER")
    return agree


if __name__ == "__main__":
    sys.exit(0 if main(dump_dir="saved_graph_mirrored") else 1)
