"""Networks whose IR dumps are checked in under tests/golden/. Their source lines
appear in the dumps, so edit this file only together with regenerating them
(pytest tests/test_golden.py --regen-golden)."""
import jax
import jax.numpy as jnp
import numpy as np

from compiler import shard


def seed_net(x, w1, w2):
    h = shard(jnp.matmul, ((2, 4), (4, 1)))(x, w1)
    h = jax.nn.relu(h)
    return jnp.matmul(h, w2)


def seed_args():
    rng = np.random.default_rng(1)
    return (rng.random((16, 32), dtype=np.float32), rng.standard_normal((32, 16)).astype(np.float32),
            rng.standard_normal((16, 16)).astype(np.float32))
