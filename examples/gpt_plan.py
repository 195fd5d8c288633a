"""A GPT training step to plan for a cluster that is not here (docs/guide/planning.md).

    shardprop plan examples/gpt_plan.py:make_step --mesh 128x8:dp,mp --cluster 128x8:a100-80gb

``make_step()`` returns what ``shardprop plan`` needs: the step function, its
arguments as ``jax.ShapeDtypeStruct``s (no memory, no devices) and options for
``sp.plan_step`` (tokens per step). The model is Megatron's GPT: the QKV projection
split by heads and the first MLP matmul by columns over ``mp`` (the rest is
inferred), the batch split over ``dp``, the tied embedding split by vocabulary over
``mp``; mixed precision (fp32 master weights and Adam state, bf16 matmuls and
activations) and full activation recomputation per layer (``jax.checkpoint``), as
the published runs train.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import shardprop as sp


@dataclass(frozen=True)
class GPT:
    layers: int = 96
    hidden: int = 12288
    heads: int = 96
    seq: int = 2048
    vocab: int = 51200
    batch: int = 1536          # sequences per step, all data-parallel replicas together
    compute_dtype: str = "bfloat16"   # matmuls and activations; "float32": no mixed precision
    remat: bool = True         # recompute each layer's activations in the backward (jax.checkpoint)
    # as Megatron-LM's and PaddleNLP's GPTs train: dropout on the embeddings, the attention
    # probabilities and each residual branch, and a bias on every linear layer
    dropout: float = 0.0
    bias: bool = False
    dp: str = "dp"             # mesh axis names (None: not split over that axis)
    mp: str = "mp"

    @property
    def params(self) -> int:
        """Parameters: 12 h^2 + 4 h per layer (norms) and 9 h more with biases, the
        embeddings and the last norm."""
        h = self.hidden
        return self.layers * (12 * h * h + (13 if self.bias else 4) * h) + (self.vocab + self.seq) * h + 2 * h


def _norm(x, g, b):
    x32 = x.astype(jnp.float32)
    m = x32.mean(-1, keepdims=True)
    v = ((x32 - m) ** 2).mean(-1, keepdims=True)
    return ((x32 - m) * jax.lax.rsqrt(v + 1e-5) * g + b).astype(x.dtype)


def _dropout(cfg: GPT, x, key):
    """Inverted dropout at ``cfg.dropout`` (to 1/256): one random byte per element, kept
    where it is at least ``cfg.dropout * 256``; a byte mask, as PyTorch's dropout keeps."""
    if not cfg.dropout:
        return x
    keep = jax.random.bits(key, x.shape, jnp.uint8) >= jnp.uint8(round(cfg.dropout * 256))
    return jnp.where(keep, x / jnp.asarray(1.0 - cfg.dropout, x.dtype), jnp.zeros((), x.dtype))


def _layer(cfg: GPT, x, p, key):
    dt = jnp.dtype(cfg.compute_dtype)
    b, s, h = x.shape
    w = {k: v.astype(dt) for k, v in p.items()}
    keys = jax.random.split(key, 3) if cfg.dropout else (None,) * 3
    heads = (P(cfg.dp, None, None), P(None, cfg.mp, None))
    y = _norm(x, p["ln1_g"], p["ln1_b"])
    project = sp.shard(lambda a, wt: jnp.einsum("bse,ehd->bshd", a, wt), heads)
    q, k, v = project(y, w["wq"]), project(y, w["wk"]), project(y, w["wv"])
    if cfg.bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(h // cfg.heads).astype(dt)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    att = _dropout(cfg, jax.nn.softmax(jnp.where(causal, scores, jnp.asarray(-1e4, dt)), axis=-1), keys[0])
    y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, h) @ w["wo"]
    x = x + _dropout(cfg, y + w["bo"] if cfg.bias else y, keys[1])
    y = _norm(x, p["ln2_g"], p["ln2_b"])
    y = sp.shard(jnp.matmul, (P(cfg.dp, None, None), P(None, cfg.mp)))(y, w["w1"])
    y = jax.nn.gelu(y + w["b1"] if cfg.bias else y) @ w["w2"]
    return x + _dropout(cfg, y + w["b2"] if cfg.bias else y, keys[2])


def loss_fn(params, tokens, targets, cfg: GPT):
    dt = jnp.dtype(cfg.compute_dtype)
    wte = params["wte"].astype(dt)
    # the masks' key (only with dropout): a constant, since a plan sees shapes only (a
    # training loop would fold in its step number); each layer folds in its index
    key = jax.random.key(0) if cfg.dropout else None
    x = _dropout(cfg, (jnp.take(wte, tokens, axis=0) + params["wpe"].astype(dt)[None]).astype(dt), key)
    layer = (jax.checkpoint(lambda x, p, k: _layer(cfg, x, p, k)) if cfg.remat
             else (lambda x, p, k: _layer(cfg, x, p, k)))
    for n, p in enumerate(params["layers"]):
        x = layer(x, p, jax.random.fold_in(key, n + 1) if cfg.dropout else None)
    x = _norm(x, params["lnf_g"], params["lnf_b"])
    logits = sp.shard(lambda a, e: jnp.einsum("bsh,vh->bsv", a, e),
                      (P(cfg.dp, None, None), P(cfg.mp, None)))(x, wte)        # tied head, vocab split
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def abstract_params(cfg: GPT) -> dict:
    """The parameters as ``jax.ShapeDtypeStruct``s: fp32 master weights."""
    h, f32, S = cfg.hidden, jnp.float32, jax.ShapeDtypeStruct
    d = h // cfg.heads
    layer = dict(ln1_g=S((h,), f32), ln1_b=S((h,), f32), wq=S((h, cfg.heads, d), f32),
                 wk=S((h, cfg.heads, d), f32), wv=S((h, cfg.heads, d), f32), wo=S((h, h), f32),
                 ln2_g=S((h,), f32), ln2_b=S((h,), f32), w1=S((h, 4 * h), f32), w2=S((4 * h, h), f32))
    if cfg.bias:
        layer.update(bq=S((cfg.heads, d), f32), bk=S((cfg.heads, d), f32), bv=S((cfg.heads, d), f32),
                     bo=S((h,), f32), b1=S((4 * h,), f32), b2=S((h,), f32))
    return dict(wte=S((cfg.vocab, h), f32), wpe=S((cfg.seq, h), f32), layers=[dict(layer) for _ in range(cfg.layers)],
                lnf_g=S((h,), f32), lnf_b=S((h,), f32))


def train_step_and_args(cfg: GPT, learning_rate: float = 1e-4):
    """(step, (params, opt_state, tokens, targets)): Adam, every argument abstract."""
    import optax
    opt = optax.adam(learning_rate)

    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    return train_step, (params, jax.eval_shape(opt.init, params), tokens, tokens)


def make_step():
    """What ``shardprop plan examples/gpt_plan.py:make_step`` plans: a GPT-3 175B-like
    step (96 layers, hidden 12288, 96 heads, seq 2048, batch 1536)."""
    cfg = GPT()
    step, args = train_step_and_args(cfg)
    return step, args, {"tokens": cfg.batch * cfg.seq}


def make_step_fsdp():
    """The same step with its parameters and Adam state stored split over ``dp`` and
    gathered at use (``parallelize(shard_params=True)``: ZeRO-3 / FSDP)."""
    step, args, options = make_step()
    return step, args, {**options, "shard_params": True}
