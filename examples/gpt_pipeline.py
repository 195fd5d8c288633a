"""The GPT of examples/gpt_megatron.py, pipelined: stages cut by ``sp.stage_boundary``.

    python examples/gpt_pipeline.py            # 8 layers on pp=8 (gpipe, 1f1b), then pp=4 interleaved v=2
    python examples/gpt_pipeline.py --mp       # Megatron's layer: pp=4 x mp=2, then pp=2 x dp=2 x mp=2 with ZeRO-1

The step is the same whole training step (``value_and_grad`` + Adam) written for one
device; ``sp.parallelize(..., pipeline=sp.Pipeline(microbatches=m, schedule=...))`` splits
the batch into ``m`` micro-batches, runs each stage's forward and backward in the
schedule's order on its own rank of the ``pp`` axis, accumulates the gradients and
applies Adam once. With ``tied=True`` the LM head is the embedding's transpose, used by
the first and the last stage: its two accumulated gradients go between those two
stages' ranks only, and its update runs there (``docs/design/pipeline.md``).

With ``--mp`` every layer is gpt_megatron's, with its two marks per layer: each stage runs
tensor parallel over the ``mp`` axis (the step is planned once on the axes beside ``pp``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

if __name__ == "__main__" and "--gpu" not in sys.argv:
    import shardprop as sp
    sp.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import shardprop as sp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from gpt_megatron import (Config, Parallelism, adam_train_step, attention, init_params, layer_norm,  # noqa: E402
                          make_batch, mlp)


def block(x, p, cfg: Config):
    b, s, e = x.shape
    h = layer_norm(x, p["ln1_g"], p["ln1_b"])
    q, k, v = (jnp.einsum("bse,ehd->bshd", h, p[n]) for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, e) @ p["wo"]
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def stage_cuts(layers: int, stages: int) -> set:
    """Layer indices after which a stage ends (even split; the first and the last stage
    also hold the embedding and the head)."""
    bounds = np.linspace(0, layers, stages + 1).round().astype(int)
    return {int(b) - 1 for b in bounds[1:-1]}


@dataclass(frozen=True)
class TensorParallel:
    """examples/gpt_megatron.py's two marks per layer (``layers``), and Megatron's
    vocab-parallel embedding and head (the one-hot lookup's table and the head split
    by vocab rows over ``mp``), so every large weight is split over ``mp``."""
    layers: Parallelism
    embedding: tuple
    head: tuple


def tensor_parallel(dp: bool = False) -> TensorParallel:
    """The marks on a mesh with an ``mp`` axis (and a ``dp`` axis splitting the batch), as
    PartitionSpecs: with ``pp`` on the mesh, split counts would not say which axis they mean."""
    b = "dp" if dp else None
    return TensorParallel(Parallelism(heads=(P(b, None, None), P(None, "mp", None)),
                                      columns=(P(b, None, None), P(None, "mp"))),
                          embedding=(P(b, None, "mp"), P("mp", None)), head=(P(b, None, None), P(None, "mp")))


def loss_fn(params, tokens, targets, cfg: Config, cuts: set, tp: TensorParallel = None):
    one_hot = jax.nn.one_hot(tokens, cfg.vocab, dtype=jnp.float32)
    x = (sp.shard(jnp.matmul, tp.embedding) if tp else jnp.matmul)(one_hot, params["wte"]) + params["wpe"]
    par = tp.layers if tp else None
    for i, p in enumerate(params["layers"]):
        # Megatron's layer (gpt_megatron's attention and mlp, two marks) or the unmarked block
        x = mlp(attention(x, p, par, cfg), p, par) if par is not None else block(x, p, cfg)
        if i in cuts:
            x = sp.stage_boundary(x)
    head = params["head"] if "head" in params else params["wte"].T        # untied, or tied to the embedding
    logits = (sp.shard(jnp.matmul, tp.head) if tp else jnp.matmul)(layer_norm(x, params["lnf_g"], params["lnf_b"]),
                                                                   head)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, cfg.vocab) * logp, axis=-1))


def init_pipeline_params(cfg: Config, seed: int = 0, tied: bool = False):
    params = init_params(cfg, seed)
    if not tied:
        params["head"] = np.ascontiguousarray(params["wte"].T)   # an untied head
    return params


def make_train_step(cfg: Config, stages: int, learning_rate: float = 1e-3, tp: TensorParallel = None):
    cuts = stage_cuts(cfg.layers, stages)
    return adam_train_step(lambda params, tokens, targets: loss_fn(params, tokens, targets, cfg, cuts, tp),
                           learning_rate)


def main():
    cfg = Config(layers=8, batch=8)
    tokens, targets = make_batch(cfg)
    if "--mp" in sys.argv:   # (mesh, schedule, v, tied, Megatron marks, ZeRO-1)
        cases = [(((4, 2), ("pp", "mp")), "1f1b", 1, False, tensor_parallel(), False),
                 (((4, 2), ("pp", "mp")), "interleaved", 2, False, tensor_parallel(), False),
                 (((4, 2), ("pp", "mp")), "zero_bubble", 1, True, tensor_parallel(), False),
                 (((2, 2, 2), ("pp", "dp", "mp")), "1f1b", 1, False, tensor_parallel(dp=True), True)]
    else:
        cases = [(((p,), ("pp",)), schedule, v, tied, None, False) for p, schedule, v, tied in
                 [(8, "gpipe", 1, False), (8, "1f1b", 1, False), (4, "interleaved", 2, False), (4, "1f1b", 1, True)]]
    for mesh, schedule, v, tied, par, zero in cases:
        p = mesh[0][0]
        params = init_pipeline_params(cfg, tied=tied)
        step, opt = make_train_step(cfg, p * v, tp=par)
        state = opt.init(params)
        pstep = sp.parallelize(step, mesh=mesh, batch_argnums=(2, 3), shard_optimizer_state=zero,
                               pipeline=sp.Pipeline(microbatches=2 if zero else 4, schedule=schedule,
                                                    virtual_stages=v))
        plan = pstep.plan(params, state, tokens, targets)
        print(f"== {dict(zip(mesh[1], mesh[0]))} {schedule} v={v}{' tied head' if tied else ''}"
              f"{' ZeRO-1' if zero else ''}: {plan.pipeline.ticks} ticks, modeled bubble {plan.pipeline.bubble:.3f}")
        print(plan.pipeline.render())
        p1, s1, p0, s0 = params, state, params, state
        for _ in range(3):
            p1, s1, l1 = pstep(p1, s1, tokens, targets)
            p0, s0, l0 = jax.jit(step)(p0, s0, tokens, targets)
        print(f"   loss after 3 steps {float(l1):.6f} (single device {float(l0):.6f})")
        assert abs(float(l1) - float(l0)) < 1e-5 * max(1.0, abs(float(l0)))


if __name__ == "__main__":
    main()
