"""The quickstart network across processes: run it with the launcher,

    shardprop launch --nproc 2 --devices-per-proc 4 examples/multiprocess_quickstart.py

and the two processes (4 CPU devices each) form one 8-device mesh. The script is
the single-process one: parallelize joins the distributed runtime itself. Each
process writes the IR dumps of the ranks it owns; process 0 prints the result.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import shardprop as sp


def net(x, w1, w2):
    h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, w1)
    h = jax.nn.relu(h)
    return jnp.matmul(h, w2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump-dir", default="saved_graph")
    ap.add_argument("--out", default=None, help="write the result (.npy) here, from process 0")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    x = rng.random((16, 32), dtype=np.float32)
    w1 = rng.standard_normal((32, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 16)).astype(np.float32)
    y = sp.parallelize(net, mesh=8, dump_dir=args.dump_dir)(x, w1, w2)
    result = sp.to_numpy(y)
    sp.print0(f"process {jax.process_index()} of {jax.process_count()}: {jax.device_count()} devices; "
           f"result checksum {float(result.sum()):.6f}")
    if args.out and jax.process_index() == 0:
        np.save(args.out, result)


if __name__ == "__main__":
    main()
