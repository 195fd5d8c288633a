"""A small GPT, tensor parallel the Megatron way, from two annotations per layer.

Only the QKV projection (heads split) and the first MLP matmul (columns split)
of each layer are marked. Propagation infers the rest: attention runs per head
group, the out-projection and the second MLP matmul take row-split weights,
and each block ends in exactly one all_reduce forward (and one backward).

    python examples/gpt_megatron.py            # 8-way tensor parallel, then 2 x 4 (dp x mp)

The model is plain jax.numpy; ``make_train_step`` builds a whole training step
(forward, backward, Adam) that ``parallelize`` turns into one SPMD program.
"""
from __future__ import annotations

import sys

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)   # any machine can run it (unless a launcher chose the devices)

from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardprop as sp  # noqa: E402


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    seq: int = 16
    heads: int = 8
    head_dim: int = 8
    layers: int = 2
    batch: int = 4

    @property
    def embed(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class Parallelism:
    """The two annotations per layer, for a 1-D mesh of ``mp`` devices or a named dp x mp mesh.
    Sequence parallelism also marks the layer norms (split on the sequence dim) and
    the row-parallel matmuls, whose ``out_strategy`` asks for a sequence split:
    MindSpore's reduce-scatter form."""
    heads: tuple
    columns: tuple
    norms: tuple = None
    rows: tuple = None
    rows_out: tuple = None

    @staticmethod
    def tensor(mp: int = 8) -> "Parallelism":
        return Parallelism(heads=((1, 1, 1), (1, mp, 1)), columns=((1, 1, 1), (1, mp)))

    @staticmethod
    def sequence(mp: int = 8) -> "Parallelism":
        """Megatron's sequence parallelism: layer norms (and the residual stream) split on
        the sequence dim, so each block gathers before its first matmul and
        reduce-scatters after its last, instead of one all_reduce."""
        return Parallelism(heads=((1, 1, 1), (1, mp, 1)), columns=((1, 1, 1), (1, mp)),
                           norms=((1, mp, 1), (1,), (1,)), rows=((1, 1, mp), (mp, 1)), rows_out=((1, mp, 1),))

    @staticmethod
    def data_and_tensor() -> "Parallelism":
        return Parallelism(heads=(P("dp", None, None), P(None, "mp", None)),
                           columns=(P("dp", None, None), P(None, "mp")))


def layer_norm(x, g, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * g + b


def norm(x, g, b, par: Parallelism):
    return sp.shard(layer_norm, par.norms)(x, g, b) if par.norms else layer_norm(x, g, b)


def row_parallel(x, w, par: Parallelism):
    return sp.shard(jnp.matmul, par.rows, par.rows_out)(x, w) if par.rows else x @ w


def attention(x, p, par: Parallelism, cfg: Config):
    b, s, e = x.shape
    h = norm(x, p["ln1_g"], p["ln1_b"], par)
    project = sp.shard(lambda a, w: jnp.einsum("bse,ehd->bshd", a, w), par.heads)   # QKV: heads split
    q, k, v = project(h, p["wq"]), project(h, p["wk"]), project(h, p["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, e)
    return x + row_parallel(out, p["wo"], par)                                   # row-parallel: inferred


def mlp(x, p, par: Parallelism):
    h = norm(x, p["ln2_g"], p["ln2_b"], par)
    h = sp.shard(jnp.matmul, par.columns)(h, p["w1"])                               # columns split
    return x + row_parallel(jax.nn.gelu(h), p["w2"], par)                        # row-parallel: inferred


def forward(params, tokens, par: Parallelism, cfg: Config):
    x = jax.nn.one_hot(tokens, cfg.vocab, dtype=jnp.float32) @ params["wte"] + params["wpe"]
    for p in params["layers"]:
        x = mlp(attention(x, p, par, cfg), p, par)
    x = layer_norm(x, params["lnf_g"], params["lnf_b"])
    return x @ params["wte"].T                                                   # tied LM head


def loss_fn(params, tokens, targets, par: Parallelism, cfg: Config):
    logp = jax.nn.log_softmax(forward(params, tokens, par, cfg), axis=-1)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, cfg.vocab) * logp, axis=-1))


def init_params(cfg: Config, seed: int = 0):
    rng = np.random.default_rng(seed)
    e, f = cfg.embed, 4 * cfg.embed

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)
    ones, zeros = np.ones(e, np.float32), np.zeros(e, np.float32)
    layers = [dict(ln1_g=ones, ln1_b=zeros, wq=w(e, cfg.heads, cfg.head_dim), wk=w(e, cfg.heads, cfg.head_dim),
                   wv=w(e, cfg.heads, cfg.head_dim), wo=w(e, e), ln2_g=ones, ln2_b=zeros, w1=w(e, f), w2=w(f, e))
              for _ in range(cfg.layers)]
    return dict(wte=w(cfg.vocab, e), wpe=w(cfg.seq, e), layers=layers, lnf_g=ones, lnf_b=zeros)


def make_batch(cfg: Config, seed: int = 1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def adam_train_step(loss, learning_rate: float = 1e-3):
    """The whole step for ``loss(params, tokens, targets)``: value_and_grad and Adam's
    update, as one function (what parallelize compiles), and the optimizer."""
    import optax
    opt = optax.adam(learning_rate)

    def train_step(params, opt_state, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return train_step, opt


def make_train_step(par: Parallelism, cfg: Config, learning_rate: float = 1e-3):
    return adam_train_step(lambda params, tokens, targets: loss_fn(params, tokens, targets, par, cfg), learning_rate)


def main():
    cfg = Config()
    params = init_params(cfg)
    tokens, targets = make_batch(cfg)
    for title, par, mesh in [("8-way tensor parallel", Parallelism.tensor(8), 8),
                             ("2 x 4: data parallel x tensor parallel", Parallelism.data_and_tensor(),
                              ((2, 4), ("dp", "mp")))]:
        step, opt = make_train_step(par, cfg)
        state = opt.init(params)
        pstep = sp.parallelize(step, mesh=mesh, donate_argnums=(0, 1))   # params and state come back as they went in
        plan = pstep.plan(params, state, tokens, targets)
        print(f"== {title}: {len(plan.ops)} operators, collectives {plan.counts()}")
        p1, s1, l1 = pstep(params, state, tokens, targets)
        p0, s0, l0 = jax.jit(step)(params, state, tokens, targets)
        print(f"   loss {float(l1):.6f} (single device {float(l0):.6f})")
        assert abs(float(l1) - float(l0)) < 1e-5


if __name__ == "__main__":
    main()
