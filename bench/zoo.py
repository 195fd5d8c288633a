"""The comparison cases. Each is written once, with ``annotate(fn, specs)`` on the
operators a user would mark; the harness gives those marks to shardprop as
``shard()`` and to XLA as ``with_sharding_constraint`` on the marked operator's
inputs (everything else left to each system)."""
from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardprop as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


class Annotator:
    """``annotate(fn, specs)(*args)``: shardprop's shard(), or XLA constraints on the inputs."""

    def __init__(self):
        self.mode, self.mesh = "shardprop", None

    def __call__(self, fn, specs, out_specs=None):
        if self.mode == "plain":          # the single-device reference, and the unmarked program
            return fn
        if self.mode == "shardprop":
            return sp.shard(fn, specs, out_specs)
        mesh = self.mesh

        def constrained(*args):
            args = [jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
            out = fn(*args)
            if out_specs is not None:
                out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, out_specs[0]))
            return out
        return constrained


annotate = Annotator()


@contextlib.contextmanager
def marks_through_annotate(module):
    """An example written for users calls ``sp.shard`` itself; while the harness traces
    it, that name is ``annotate``, so its marks go wherever the harness's mode sends
    them (none in "plain": the unmarked program that mode="auto", data parallel and the
    single-device reference run)."""
    real = module.sp
    module.sp = types.SimpleNamespace(**{**{k: getattr(real, k) for k in real.__all__}, "shard": annotate})
    try:
        yield
    finally:
        module.sp = real


@dataclass
class Case:
    name: str
    mesh: tuple                         # (shape, axis names)
    fn: Callable
    args: Callable[[], tuple]
    floor_bytes: Optional[Callable[[], float]] = None   # analytic minimum bytes per device, where known
    note: str = ""
    train: bool = False                 # a training step: returns the new state first, then the loss
    state_argnums: tuple = ()           # (train) the arguments its outputs replace, in order


def _rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- the seed network and the MindSpore FFN -----------------------------------------------
def seed(x, w1, w2):
    h = annotate(jnp.matmul, (P("a", "b"), P("b", None)))(x, w1)   # ((2, 4), (4, 1))
    return jnp.matmul(jax.nn.relu(h), w2)


def ffn(x, w1, b1, w2, b2):
    h = annotate(jnp.matmul, (P("a", None), P(None, "b")))(x, w1)  # ((2, 1), (1, 4))
    return jnp.matmul(jax.nn.relu(h + b1), w2) + b2


# -- Megatron blocks, annotated on their first matmuls ---------------------------------------
B, S, E, H = 4, 64, 256, 8


def megatron_mlp(x, w1, w2):
    h = annotate(jnp.matmul, (P(None, None, None), P(None, "mp")))(x, w1)
    return x + jax.nn.gelu(h) @ w2


def megatron_attention(x, wq, wk, wv, wo):
    heads = annotate(lambda a, w: jnp.einsum("bse,ehd->bshd", a, w), (P(None, None, None), P(None, "mp", None)))
    q, k, v = heads(x, wq), heads(x, wk), heads(x, wv)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(E // H)
    causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(causal, s, -1e9), -1), v).reshape(B, S, E)
    return x + o @ wo


def _block_output_floor(mp=8):
    """Least a block can move: its output is a sum over mp devices, so each must at least
    reduce-scatter it ((n-1)/n of the activation); an all_reduce moves twice that."""
    return (mp - 1) / mp * B * S * E * 4


# -- GPT training steps (examples/gpt_megatron.py, its marks routed through annotate) --------
def gpt_case(layers: int, dp: int, shape: tuple = (2, 4)):
    import gpt_megatron as G
    cfg = G.Config(layers=layers, batch=8, seq=32, heads=8, head_dim=16, vocab=256)
    if dp == 1:
        par = G.Parallelism(heads=(P(None, None, None), P(None, "mp", None)), columns=(P(None, None, None), P(None, "mp")))
    else:
        par = G.Parallelism.data_and_tensor()

    def fn(params, state, tokens, targets):
        with marks_through_annotate(G):   # the example's marks, given to whichever system runs
            return step(params, state, tokens, targets)
    step, opt = G.make_train_step(par, cfg)

    def args():
        params = G.init_params(cfg)
        tokens, targets = G.make_batch(cfg)
        return params, opt.init(params), tokens, targets
    mesh = ((8,), ("mp",)) if dp == 1 else (tuple(shape), ("dp", "mp"))
    return Case(f"gpt{layers}_train_{'mp8' if dp == 1 else f'dp{shape[0]}xmp{shape[1]}'}", mesh, fn, args, train=True,
                state_argnums=(0, 1), note="forward, backward, Adam")


# -- a small CNN, data parallel ----------------------------------------------------------------
def cnn(x, k1, k2, w):
    nhwc = ("NHWC", "HWIO", "NHWC")
    conv = annotate(lambda a, k: jax.lax.conv_general_dilated(a, k, (1, 1), "SAME", dimension_numbers=nhwc),
                    (P("d", None, None, None), P(None, None, None, None)))
    h = jax.nn.relu(conv(x, k1))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, k2, (1, 1), "SAME", dimension_numbers=nhwc))
    return jnp.mean(h, axis=(1, 2)) @ w


def cnn_train(params, x, y):
    def loss(p):
        return jnp.mean((cnn(x, *p) - y) ** 2)
    l, g = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), l


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    return [
        Case("seed_network", ((2, 4), ("a", "b")), seed,
             lambda: (_rand(rng, 16, 32), _rand(rng, 32, 16), _rand(rng, 16, 16)),
             note="MindSpore quickstart, first matmul ((2,4),(4,1))"),
        Case("seed_network_4096x1024", ((2, 4), ("a", "b")), seed,
             lambda: (_rand(rng, 4096, 1024), _rand(rng, 1024, 1024, scale=.03), _rand(rng, 1024, 1024, scale=.03)),
             note="the seed network at x 4096 x 1024 (weights 1024 x 1024), the same mark"),
        Case("mindspore_ffn", ((2, 4), ("a", "b")), ffn,
             lambda: (_rand(rng, 64, 128), _rand(rng, 128, 256, scale=.1), np.zeros(256, np.float32),
                      _rand(rng, 256, 128, scale=.1), np.zeros(128, np.float32)),
             note="first matmul ((2,1),(1,4))"),
        Case("megatron_mlp", ((8,), ("mp",)), megatron_mlp,
             lambda: (_rand(rng, B, S, E), _rand(rng, E, 4 * E, scale=.05), _rand(rng, 4 * E, E, scale=.05)),
             floor_bytes=_block_output_floor, note="first matmul column split"),
        Case("megatron_attention", ((8,), ("mp",)), megatron_attention,
             lambda: (_rand(rng, B, S, E), _rand(rng, E, H, E // H, scale=.05), _rand(rng, E, H, E // H, scale=.05),
                      _rand(rng, E, H, E // H, scale=.05), _rand(rng, E, E, scale=.05)),
             floor_bytes=_block_output_floor, note="QKV heads split"),
        gpt_case(2, 1), gpt_case(12, 1), gpt_case(2, 2), gpt_case(12, 2),
        Case("cnn_data_parallel", ((8,), ("d",)), cnn_train,
             lambda: ((_rand(rng, 3, 3, 3, 16, scale=.2), _rand(rng, 3, 3, 16, 16, scale=.1), _rand(rng, 16, 10, scale=.1)),
                      _rand(rng, 32, 16, 16, 3), _rand(rng, 32, 10)),
             note="first conv batch split; SGD step", train=True, state_argnums=(0,)),
    ]


def limit_cases() -> list[Case]:
    """More cases for ``compare.py --limits``: the GPT steps on 4 x 2 too, and at 48 layers
    (issue 27's matrix: 2, 12 and 48 layers on 8, 2 x 4 and 4 x 2)."""
    return [gpt_case(2, 2, (4, 2)), gpt_case(12, 2, (4, 2)),
            gpt_case(48, 1), gpt_case(48, 2), gpt_case(48, 2, (4, 2))]
