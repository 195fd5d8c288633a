"""A small ResNet, data parallel with one model-parallel layer, as MindSpore's ResNet sample.

The first convolution marks the batch split over all 8 devices; the classifier
marks its weight split by output classes (model parallel). Everything in
between (convolutions, batch norm over the split batch, ReLU, residual adds,
pooling) follows the batch split by propagation; the gradient reductions of the
convolution weights are derived, and the switch from a batch-split activation to
the model-parallel classifier is planned by the compiler.

    python examples/resnet.py        # a few Momentum steps, losses checked against one device
"""
from __future__ import annotations

import sys

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)   # any machine can run it (unless a launcher chose the devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardprop as sp  # noqa: E402

NHWC = ("NHWC", "HWIO", "NHWC")
DEVICES = 8


def conv(x, w, stride=1):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=NHWC)


def batch_norm(x, gamma, beta, eps=1e-5):
    """Training-mode batch norm: statistics over the (split) batch and spatial dims."""
    mean = x.mean(axis=(0, 1, 2))
    var = ((x - mean) ** 2).mean(axis=(0, 1, 2))
    return (x - mean) * jax.lax.rsqrt(var + eps) * gamma + beta


def block(x, p):
    h = jax.nn.relu(batch_norm(conv(x, p["w1"]), p["g1"], p["b1"]))
    h = batch_norm(conv(h, p["w2"]), p["g2"], p["b2"])
    return jax.nn.relu(x + h)


def resnet(params, images):
    stem = sp.shard(conv, ((DEVICES, 1, 1, 1), (1, 1, 1, 1)))          # data parallel: batch split
    x = jax.nn.relu(batch_norm(stem(images, params["stem"]), params["g0"], params["b0"]))
    for p in params["blocks"]:
        x = block(x, p)
    x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
    x = x.mean(axis=(1, 2))                                          # global average pool
    classifier = sp.shard(jnp.matmul, ((1, 1), (1, DEVICES)))           # model parallel: classes split
    return classifier(x, params["fc"]) + params["fc_b"]


def loss_fn(params, images, labels):
    logp = jax.nn.log_softmax(resnet(params, images), axis=-1)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, logp.shape[-1]) * logp, axis=-1))


def init_params(channels=8, blocks=2, classes=16, seed=0):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[:-1]))).astype(np.float32)
    ones, zeros = np.ones(channels, np.float32), np.zeros(channels, np.float32)
    return dict(stem=w(3, 3, 3, channels), g0=ones, b0=zeros,
                blocks=[dict(w1=w(3, 3, channels, channels), g1=ones, b1=zeros,
                             w2=w(3, 3, channels, channels), g2=ones, b2=zeros) for _ in range(blocks)],
                fc=w(channels, classes), fc_b=np.zeros(classes, np.float32))


def make_train_step(learning_rate=0.05, momentum=0.9):
    opt = optax.sgd(learning_rate, momentum=momentum)

    def train_step(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step, opt


def main(steps: int = 3):
    rng = np.random.default_rng(1)
    images = rng.standard_normal((16, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 16, (16,)).astype(np.int32)
    params = init_params()
    step, opt = make_train_step()
    pstep = sp.parallelize(step, mesh=DEVICES, donate_argnums=(0, 1))
    plan = pstep.plan(params, opt.init(params), images, labels)
    print(f"{len(plan.ops)} operators; collectives: {plan.counts()}")
    fc = [o for o in plan.ops if o.primitive == "dot_general" and o.origin == "user"][0]
    print(f"classifier strategy {fc.in_strategy} (model parallel); stem input {plan.ops[0].in_strategy[0]}")
    par, single = (params, opt.init(params)), (params, opt.init(params))
    for i in range(steps):
        *par, loss = pstep(*par, images, labels)
        *single, ref = jax.jit(step)(*single, images, labels)
        print(f"step {i}: loss {float(loss):.6f}  single device {float(ref):.6f}")
        assert abs(float(loss) - float(ref)) < 1e-5


if __name__ == "__main__":
    main()
