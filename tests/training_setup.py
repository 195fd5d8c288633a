"""A small MLP classifier trained data parallel with Adam, shared by the training
tests and the resume worker (so both build exactly the same run)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardprop as sp


def net(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


def cross_entropy(logits, labels):
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * jax.nn.log_softmax(logits), axis=-1))


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((16, 32)) * 0.3).astype(np.float32), "b1": np.zeros(32, np.float32),
            "w2": (rng.standard_normal((32, 4)) * 0.3).astype(np.float32)}


def batches(n_steps=4, batch=16, seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 16)).astype(np.float32), rng.integers(0, 4, batch).astype(np.int32))
            for _ in range(n_steps)]


def make_model(mesh, **options):
    mode = {} if mesh is None else {"mode": "data_parallel"}
    return sp.Model(net, cross_entropy, optax.adam(0.05), init_params(), mesh=mesh, **mode, **options)
