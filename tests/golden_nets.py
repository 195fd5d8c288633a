"""Networks whose IR dumps are checked in under tests/golden/. Their source lines
appear in the dumps, so edit this file only together with regenerating them
(pytest tests/test_golden.py --regen-golden)."""
import jax
import jax.numpy as jnp
import numpy as np

import shardprop as sp


def seed_net(x, w1, w2):
    h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, w1)
    h = jax.nn.relu(h)
    return jnp.matmul(h, w2)


def seed_args():
    rng = np.random.default_rng(1)
    return (rng.random((16, 32), dtype=np.float32), rng.standard_normal((32, 16)).astype(np.float32),
            rng.standard_normal((16, 16)).astype(np.float32))


def transformer_layer(x, p):
    """One pre-norm transformer layer, Megatron-annotated: QKV heads split, MLP columns split."""
    def norm(t, g, b):
        m = t.mean(-1, keepdims=True)
        v = ((t - m) ** 2).mean(-1, keepdims=True)
        return (t - m) * jax.lax.rsqrt(v + 1e-5) * g + b
    b, s, e = x.shape
    h = norm(x, p["ln1_g"], p["ln1_b"])
    heads = sp.shard(lambda a, w: jnp.einsum("bse,ehd->bshd", a, w), ((1, 1, 1), (1, 8, 1)))
    q, k, v = heads(h, p["wq"]), heads(h, p["wk"]), heads(h, p["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.5
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, e) @ p["wo"]
    h = sp.shard(jnp.matmul, ((1, 1, 1), (1, 8)))(norm(x, p["ln2_g"], p["ln2_b"]), p["w1"])
    return x + jax.nn.gelu(h) @ p["w2"]


def transformer_args():
    rng = np.random.default_rng(2)
    e, heads, d = 32, 8, 4

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)
    p = dict(ln1_g=np.ones(e, np.float32), ln1_b=np.zeros(e, np.float32), wq=w(e, heads, d), wk=w(e, heads, d),
             wv=w(e, heads, d), wo=w(e, e), ln2_g=np.ones(e, np.float32), ln2_b=np.zeros(e, np.float32),
             w1=w(e, 4 * e), w2=w(4 * e, e))
    return w(2, 8, e), p
