"""The MindSpore distributed quickstart network on 8 devices, with shardprop.

    relu(x @ w1) @ w2,  x: (16, 32), w1: (32, 16), w2: (16, 16)

Only the first matmul is marked, ``((2, 4), (4, 1))``: the batch split in two,
the contracted dim in four. The relu and the second matmul are inferred. The
per-rank programs are written to ``saved_graph/`` (``rank_0/execute.ir`` is the
program rank 0 runs, to compare with MindSpore's ``rank_0/18_execute_*.ir``).

    python examples/quickstart.py          # MindSpore's form (fuse_reduce_scatter=False): the document's plan
    python examples/quickstart.py --fused  # parallelize's default: one all_reduce, a local slice, output split

By default it runs on 8 CPU devices (forced, so any machine can run it); pass
``--gpu`` on a machine with 8 GPUs to use them.
"""
import argparse
import os
import sys

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)   # any machine can run it (unless a launcher chose the devices)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import shardprop as sp  # noqa: E402


def net(x, w1, w2):
    h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, w1)  # MindSpore: ops.MatMul().shard(((2, 4), (4, 1)))
    h = jax.nn.relu(h)                              # inferred: ((2, 4),) here; ((2, 1),) with --fused
    return jnp.matmul(h, w2)                        # inferred: ((2, 4), (4, 1)) here; ((4, 1), (1, 2)) with --fused


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fused", action="store_true", help="parallelize's default plan instead of MindSpore's form")
    ap.add_argument("--dump-dir", default="saved_graph")
    ap.add_argument("--gpu", action="store_true", help="run on the machine's GPUs instead of 8 CPU devices")
    args = ap.parse_args()

    rng = np.random.default_rng(1)
    x = rng.random((16, 32), dtype=np.float32)
    w1 = rng.standard_normal((32, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 16)).astype(np.float32)

    pnet = sp.parallelize(net, mesh=8, dump_dir=args.dump_dir, fuse_reduce_scatter=args.fused)
    y = pnet(x, w1, w2)
    ref = jax.jit(net)(x, w1, w2)
    err = float(np.max(np.abs(np.asarray(y) - np.asarray(ref))))

    plan = pnet.plan(x, w1, w2)
    print(plan)
    print()
    print(f"max |parallel - single device| = {err:.2e}")
    print(f"IR dumps written to {args.dump_dir}/ (rank_0/execute.ir is what rank 0 runs)")
    print()
    with open(os.path.join(args.dump_dir, "rank_0", "execute.ir")) as f:
        print(f.read())
    assert err < 1e-5, "parallel result differs from the single-device result"


if __name__ == "__main__":
    main()
