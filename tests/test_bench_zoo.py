"""The benchmark cases give their marks to the system the harness names, and to no other:
a GPT step written for users (``examples/gpt_megatron.py`` calls ``sp.shard`` itself) is
unmarked for mode="auto", data parallel and the single-device reference, marked for
shardprop, and constrained for XLA."""
import collections

import jax
import jax.extend
import numpy as np
from jax.sharding import AxisType, Mesh

from bench import zoo


def _primitives(case, mode, mesh) -> collections.Counter:
    zoo.annotate.mode, zoo.annotate.mesh = mode, mesh
    try:
        # a new function object each time: jax caches a trace by function, and the mode is not its key
        jaxpr = jax.make_jaxpr(lambda *a: case.fn(*a))(*case.args())
    finally:
        zoo.annotate.mode, zoo.annotate.mesh = "shardprop", None
    count = collections.Counter()

    def walk(j):
        for eqn in j.eqns:
            count[eqn.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jaxpr.jaxpr)
    return count


def test_gpt_case_marks_go_where_the_harness_says():
    case = next(c for c in zoo.cases() if c.name == "gpt2_train_dp2xmp4")
    shape, names = case.mesh
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
    plain = _primitives(case, "plain", mesh)
    marked = _primitives(case, "shardprop", mesh)
    constrained = _primitives(case, "xla", mesh)
    assert marked["shardprop_mark"] > 0
    assert plain["shardprop_mark"] == 0 and plain["sharding_constraint"] == 0
    assert constrained["sharding_constraint"] > 0 and constrained["shardprop_mark"] == 0
    # the example's own module is left as it was
    import gpt_megatron
    import shardprop
    assert gpt_megatron.sp is shardprop


def test_program_text_tells_programs_apart_not_call_sites():
    import jax.numpy as jnp

    from bench.compare import program_text

    def here(x):
        return jnp.sin(x) * 2

    def there(x):   # the same computation, written at another source line
        return jnp.sin(x) * 2
    x = jnp.ones(16)
    a, b = (jax.jit(f).lower(x).compile() for f in (here, there))
    assert a.as_text() != b.as_text()       # their debug tables and metadata name other lines
    assert program_text(a) == program_text(b)
    assert program_text(jax.jit(lambda x: jnp.cos(x) * 2).lower(x).compile()) != program_text(a)
