"""scan / while / cond: bodies are partitioned too, and a loop carry keeps one
layout through the loop (layers stacked with lax.scan are planned once)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardprop as sp
from tests.helpers import check_parallel

rng = np.random.default_rng(0)
X = rng.standard_normal((16, 32)).astype(np.float32)
W = (rng.standard_normal((32, 32)) * 0.1).astype(np.float32)
W1S = (rng.standard_normal((3, 32, 64)) * 0.1).astype(np.float32)
W2S = (rng.standard_normal((3, 64, 32)) * 0.1).astype(np.float32)


def stacked_mlp(x, w1s, w2s):
    def layer(h, ws):
        w1, w2 = ws
        a = sp.shard(jnp.matmul, ((1, 1), (1, 8)))(h, w1)   # column split, inside the scanned layer
        return h + jax.nn.gelu(a) @ w2, jnp.sum(a)
    return jax.lax.scan(layer, x, (w1s, w2s))


@pytest.mark.slow
def test_scan_of_megatron_layers():
    pf = check_parallel(stacked_mlp, (X, W1S, W2S))
    plan = pf.plan(X, W1S, W2S)
    scan = plan.ops[0]
    assert scan.primitive == "scan"
    # stacked weights keep the layer dim whole and split like one layer: w1 columns, w2 rows
    assert scan.in_strategy[1] == (1, 1, 8) and scan.in_strategy[2] == (1, 8, 1)
    assert scan.origin == "from shard() inside the scan body"
    # the carry goes in and comes out replicated; one all_reduce per layer, in the body
    assert scan.in_strategy[0] == scan.out_strategy[0] == (1, 1)
    body_reductions = [c for c in plan.collectives if c.kind == "all_reduce" and c.in_shape == (16, 32)]
    assert len(body_reductions) == 1


def test_while_loop():
    def f(x, w):
        h = sp.shard(jnp.matmul, ((8, 1), (1, 1)))(x, w)
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, h))[1]
    pf = check_parallel(f, (X, W), grads=False)
    assert pf.plan(X, W).ops[-1].in_strategy[-1] == (8, 1)   # the carry stays split by rows


def test_cond_both_branches():
    def f(x, w, p):
        h = sp.shard(jnp.matmul, ((2, 4), (4, 1)))(x, w)
        return jax.lax.cond(p > 0, lambda a: jnp.sin(a) @ w, lambda a: a * 2.0, h)
    for p in (np.float32(1.0), np.float32(-1.0)):
        check_parallel(f, (X, W, p), argnums=(0, 1))


def test_fori_loop_with_contraction_split_inside():
    def f(x, w):
        return jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(sp.shard(jnp.matmul, ((1, 8), (8, 1)))(h, w)), x)
    check_parallel(f, (X, W))


def test_loop_body_in_dumps(tmp_path):
    sp.parallelize(stacked_mlp, mesh=8, dump_dir=str(tmp_path))(X, W1S, W2S)
    text = (tmp_path / "rank_3" / "execute.ir").read_text()
    assert "scan(" in text and "body 0 {" in text and "yield" in text
    assert "all_reduce(" in text.split("body 0 {")[1]
