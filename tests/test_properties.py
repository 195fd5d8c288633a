"""Property tests (hypothesis): random small elementwise/matmul programs with
random strategies on random ops compute the single-device result, and the
plan keeps every user strategy as given."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardprop as sp
from tests.helpers import assert_trees_close

DIMS = (8, 16)
SPLITS = (1, 2, 4, 8)


@st.composite
def split_counts(draw, shape, budget=8):
    out = []
    for n in shape:
        choices = [s for s in SPLITS if n % s == 0 and budget % s == 0]
        s = draw(st.sampled_from(choices))
        budget //= s
        out.append(s)
    return tuple(out)


@st.composite
def programs(draw):
    """A list of instructions over a growing pool of 2-D tensors."""
    shapes = [(draw(st.sampled_from(DIMS)), draw(st.sampled_from(DIMS))) for _ in range(2)]
    pool = list(shapes)
    prog = []
    for _ in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["unary", "add", "mul", "matmul", "transpose", "reduce_bcast"]))
        i = draw(st.integers(0, len(pool) - 1))
        a = pool[i]
        if kind in ("add", "mul"):
            js = [j for j, s in enumerate(pool) if s == a]
            j = draw(st.sampled_from(js))
            operands, out = (i, j), a
        elif kind == "matmul":
            js = [j for j, s in enumerate(pool) if s[0] == a[1]]
            if not js:
                kind, operands, out = "transpose", (i,), (a[1], a[0])
            else:
                j = draw(st.sampled_from(js))
                operands, out = (i, j), (a[0], pool[j][1])
        elif kind == "transpose":
            operands, out = (i,), (a[1], a[0])
        else:
            operands, out = (i,), a
        strategy = None
        if draw(st.booleans()):
            first = draw(split_counts(pool[operands[0]]))
            if kind in ("add", "mul"):
                strategy = (first, first)       # elementwise operands share every dim
            elif kind == "matmul":
                strategy = (first, (first[1], 1))  # the contracted dim shares its split
            else:
                strategy = (first,)
        prog.append((kind, operands, strategy))
        pool.append(out)
    return shapes, prog


OPS = {
    "unary": lambda x: jnp.tanh(x) * 1.5,
    "add": lambda x, y: x + y,
    "mul": lambda x, y: x * y,
    "matmul": lambda x, y: x @ y,
    "transpose": lambda x: x.T,
    "reduce_bcast": lambda x: x - jnp.mean(x, axis=1, keepdims=True),
}


def build(prog):
    def fn(*inputs):
        pool = list(inputs)
        for kind, operands, strategy in prog:
            op = OPS[kind]
            if strategy is not None:
                op = sp.shard(op, strategy)
            pool.append(op(*(pool[o] for o in operands)))
        results = tuple(pool[len(inputs):])   # every result is used: nothing is dead code
        return results, sum(jnp.sum(r ** 2) for r in results)
    return fn


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(0, 2 ** 31 - 1))
@pytest.mark.slow
def test_random_programs_equal_single_device(program, seed):
    shapes, prog = program
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in shapes]
    fn = build(prog)
    pf = sp.parallelize(fn, mesh=8, verify=True)
    assert_trees_close(pf(*inputs), jax.jit(fn)(*inputs), rtol=1e-4, atol=1e-4)
    plan = pf.plan(*inputs)
    user = [o.in_strategy for o in plan.ops if o.origin == "user"]
    given_strategies = [tuple(s) for _, _, s in prog if s is not None]
    # each marked op is one primitive except reduce_bcast (several); the first op of each region
    # carries the strategy as given
    for s in given_strategies:
        assert any(u[:len(s)] == s or u == s for u in user), (s, user)
    grad = jax.grad(lambda *a: fn(*a)[1], argnums=tuple(range(len(inputs))))
    assert_trees_close(sp.parallelize(grad, mesh=8, verify=True)(*inputs), jax.jit(grad)(*inputs), rtol=1e-4,
                       atol=1e-4)
