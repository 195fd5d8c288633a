"""Data parallel in one line.

A single-device training script (an MLP classifier with Adam) becomes data
parallel over 8 devices by wrapping its step:

    -    step = jax.jit(train_step)
    +    step = sp.parallelize(train_step, mesh=8, mode="data_parallel")

The batch (the step's last argument) is split on its first dim over every
device, parameters and optimizer state are replicated, and the gradient
all_reduce appears because the compiler sees the loss's sum over a split
batch, not because anyone wrote it. Add ``shard_optimizer_state=True`` for
ZeRO-1 (optimizer state split, gradients reduce-scattered, parameters
all-gathered). The same script runs on one device with ``--single-device``.

    python examples/data_parallel.py
"""
import sys

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)   # any machine can run it (unless a launcher chose the devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardprop as sp  # noqa: E402

optimizer = optax.adam(1e-2)


def mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def train_step(params, opt_state, batch):
    images, labels = batch

    def loss_fn(p):
        logp = jax.nn.log_softmax(mlp(p, images))
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def init(sizes=(64, 128, 128, 10), seed=0):
    rng = np.random.default_rng(seed)
    return [((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32))
            for a, b in zip(sizes[:-1], sizes[1:])]


def synthetic_data(n=512, seed=1):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.int32)
    centers = rng.standard_normal((10, 64)).astype(np.float32)
    images = centers[labels] + 3.0 * rng.standard_normal((n, 64)).astype(np.float32)
    return images, labels


def main(single_device: bool = "--single-device" in sys.argv, epochs: int = 3, batch_size: int = 64):
    params = init()
    opt_state = optimizer.init(params)
    if single_device:
        step = jax.jit(train_step)
    else:
        step = sp.parallelize(train_step, mesh=8, mode="data_parallel")   # the one line
    images, labels = synthetic_data()
    losses = []
    for epoch in range(epochs):
        for i in range(0, len(images), batch_size):
            params, opt_state, loss = step(params, opt_state, (images[i:i + batch_size], labels[i:i + batch_size]))
            losses.append(float(loss))
        print(f"epoch {epoch + 1}: loss {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    main()
