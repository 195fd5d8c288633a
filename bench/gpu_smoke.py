"""A smoke run on whatever accelerators jax sees (one GPU is enough): the GPT
training step and the data-parallel MLP through sp.parallelize, checked against
jax.jit on one device. Run it directly, or under the launcher:

    python bench/gpu_smoke.py
    shardprop launch --gpus 0 bench/gpu_smoke.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import shardprop  # noqa: E402,F401  (joins the launcher's run, if any)
import data_parallel  # noqa: E402
import gpt_megatron as G  # noqa: E402
import shardprop as sp  # noqa: E402


def main():
    n = jax.device_count()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}: {n} device(s), process {jax.process_index()}")
    cfg = G.Config(layers=2)
    step, opt = G.make_train_step(G.Parallelism.tensor(n), cfg)
    params = G.init_params(cfg)
    tokens, targets = G.make_batch(cfg)
    state = opt.init(params)
    got = sp.parallelize(step, mesh=n)(params, state, tokens, targets)
    want = jax.jit(step)(params, state, tokens, targets)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    print(f"gpt train step: loss {float(got[2]):.6f} vs {float(want[2]):.6f}, max |diff| {diff:.2e}")
    step_dp = sp.parallelize(data_parallel.train_step, mesh=n, mode="data_parallel")
    p, s = data_parallel.init(), data_parallel.optimizer.init(data_parallel.init())
    images, labels = data_parallel.synthetic_data()
    batch = (images[:64], labels[:64])
    a = step_dp(p, s, batch)[2]
    b = jax.jit(data_parallel.train_step)(p, s, batch)[2]
    print(f"data parallel MLP: loss {float(a):.6f} vs {float(b):.6f}")
    assert diff < 1e-3 and abs(float(a) - float(b)) < 1e-4


if __name__ == "__main__":
    main()
