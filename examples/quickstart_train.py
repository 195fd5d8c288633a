"""The MindSpore distributed quickstart's training run, on 8 devices with shardprop.

Network: in 32, hidden 16, out 16; the first matmul marked ``((2, 4), (4, 1))``;
MSE loss; Momentum with learning rate 0.2 and momentum 0.1 (MindSpore's update
``accum = momentum * accum + grad; w -= lr * accum`` is ``optax.sgd(0.2,
momentum=0.1)``); 5 epochs of 4 steps over one fixed random batch, as the seed
document's dataset yields the same batch every step. The global batch is 16 (2
per device in the document, 8 devices); the (2, 4) split divides it. Losses are
printed in MindSpore's ``LossMonitor`` form.

    python examples/quickstart_train.py                  # 8 devices
    python examples/quickstart_train.py --single-device  # the same script on one device
"""
import argparse
import sys

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)   # any machine can run it (unless a launcher chose the devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardprop as sp  # noqa: E402

IN_DIM, HIDDEN, OUT_DIM, BATCH, STEPS_PER_EPOCH, EPOCHS = 32, 16, 16, 16, 4, 5


def net(params, x):
    h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, params["w"])   # ops.MatMul().shard(((2, 4), (4, 1)))
    h = jax.nn.relu(h)
    return jnp.matmul(h, params["w2"])


def mse(outputs, labels):
    return jnp.mean((outputs - labels) ** 2)


def dataset():
    """The seed's get_dataset: one random batch (np.random.seed(1)), yielded every step."""
    np.random.seed(1)
    inputs = np.random.rand(BATCH, IN_DIM).astype(np.float32)
    labels = np.random.rand(BATCH, OUT_DIM).astype(np.float32)
    return [(inputs, labels)] * STEPS_PER_EPOCH


def init_params(seed=0):
    rng = np.random.default_rng(seed)   # MindSpore's initializer("normal"): sigma 0.01
    return {"w": (rng.standard_normal((IN_DIM, HIDDEN)) * 0.01).astype(np.float32),
            "w2": (rng.standard_normal((HIDDEN, OUT_DIM)) * 0.01).astype(np.float32)}


def train(single_device: bool = False, file=None) -> list:
    model = sp.Model(net, mse, optax.sgd(0.2, momentum=0.1), init_params(), mesh=None if single_device else 8)
    return model.train(EPOCHS, dataset(), callbacks=[sp.LossMonitor(file=file)])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--single-device", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args()
    losses = train(args.single_device)
    assert losses[-1] < losses[0], "the loss must decrease"


if __name__ == "__main__":
    main()
