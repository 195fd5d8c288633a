"""Planning at scale without the devices: a GPT training step (embed 4096, seq 2048,
Adam, Megatron's marks) planned for an ``AbstractMesh((16, 64), ("dp", "mp"))`` in a
process with 8 CPU devices, from ``jax.ShapeDtypeStruct``s (issue 28).

    python bench/plan_scale.py [--layers 12] [--auto] [--dump DIR]

With ``--pipeline`` it plans pipeline stages instead (issues 26 and 28): the step on
``((8, 8, 16), ("pp", "dp", "mp"))`` priced for ``sp.Cluster(128, 8, "a100-80gb")``
through ``sp.plan_step`` (``compiler/planning.py``), with Megatron's marks (micro-batches
and schedule searched for that mesh) or, with ``--auto``, no marks and the mesh shape
searched too (pp x dp x tp over the 1,024 devices). ``--search-only`` times the
configuration search alone (``passes/pipeline/search.py``) on the planned stage's layers.

    python bench/plan_scale.py --pipeline [--layers 12|48] [--auto] [--batch 512] [--search-only]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AbstractMesh  # noqa: E402

import shardprop as sp  # noqa: E402


def gpt_step(layers: int = 12, heads: int = 64, head_dim: int = 64, seq: int = 2048, batch: int = 16,
             vocab: int = 51200, mp: int = 64, marks: bool = True):
    """(train_step, abstract arguments) of examples/gpt_megatron.py at this size."""
    from gpt_megatron import Config, Parallelism, make_train_step
    from jax.sharding import PartitionSpec as P
    cfg = Config(vocab=vocab, seq=seq, heads=heads, head_dim=head_dim, layers=layers, batch=batch)
    par = Parallelism(heads=(P("dp", None, None), P(None, "mp", None)), columns=(P("dp", None, None), P(None, "mp")))
    step, opt = make_train_step(par, cfg)
    if not marks:   # the same step with every shard() mark an identity: nothing marked, for mode="auto"
        import types

        import gpt_megatron
        marked = step

        def step(*args):
            saved, gpt_megatron.sp = gpt_megatron.sp, types.SimpleNamespace(shard=lambda f, *a, **k: f)
            try:
                return marked(*args)
            finally:
                gpt_megatron.sp = saved
    e, f = cfg.embed, 4 * cfg.embed
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    layer = dict(ln1_g=S((e,), f32), ln1_b=S((e,), f32), wq=S((e, heads, head_dim), f32),
                 wk=S((e, heads, head_dim), f32), wv=S((e, heads, head_dim), f32), wo=S((e, e), f32),
                 ln2_g=S((e,), f32), ln2_b=S((e,), f32), w1=S((e, f), f32), w2=S((f, e), f32))
    params = dict(wte=S((vocab, e), f32), wpe=S((seq, e), f32), layers=[layer] * layers,
                  lnf_g=S((e,), f32), lnf_b=S((e,), f32))
    state = jax.eval_shape(opt.init, params)
    tokens = S((batch, seq), jnp.int32)
    return step, (params, state, tokens, tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--auto", action="store_true")
    ap.add_argument("--dump")
    ap.add_argument("--pipeline", action="store_true", help="plan pipeline stages on (8, 8, 16) pp x dp x mp")
    ap.add_argument("--batch", type=int, default=512, help="sequences per step (--pipeline)")
    ap.add_argument("--search-only", action="store_true", help="time the configuration search alone (--pipeline)")
    a = ap.parse_args(argv)
    if a.pipeline:
        return pipeline(a)
    step, args = gpt_step(a.layers, marks=not a.auto)
    mesh = AbstractMesh((16, 64), ("dp", "mp"))
    t0 = time.perf_counter()
    pstep = sp.parallelize(step, mesh=mesh, mode="auto" if a.auto else "sharding_propagation")
    plan = pstep.plan(*args)
    t1 = time.perf_counter()
    print(f"GPT-{a.layers} on {dict(zip(mesh.axis_names, mesh.axis_sizes))} "
          f"({'auto' if a.auto else 'marks'}): planned in {t1 - t0:.1f} s, {len(plan.collectives)} collectives")
    if a.dump:
        t0 = time.perf_counter()
        plan.dump(a.dump)
        print(f"dump: {time.perf_counter() - t0:.2f} s")
    return 0


def pipeline(a) -> int:
    step, args = gpt_step(a.layers, batch=a.batch, marks=not a.auto)
    cluster = sp.Cluster(128, 8, "a100-80gb")
    mesh = ((8, 8, 16), ("pp", "dp", "mp"))
    mode = "auto" if a.auto else "sharding_propagation"
    t0 = time.perf_counter()
    est = sp.plan_step(step, args, mesh=mesh, cost_model=cluster, mode=mode, tokens=a.batch * 2048)
    t1 = time.perf_counter()
    pipe = est.extra["pipeline"]
    print(f"GPT-{a.layers} (batch {a.batch}) on {dict(zip(mesh[1], mesh[0]))} ({'auto' if a.auto else 'marks'}): "
          f"planned in {t1 - t0:.1f} s (the configuration search {pipe['search'].seconds:.2f} s)")
    print(est)
    print(pipe["search"].table(8))
    if a.search_only:
        # the search alone (passes/pipeline/search.py), timed on the planned stages' layers:
        # for this mesh (m and schedule), and over pp x dp x tp x m x schedule with every tp
        # of a node planned (with the marks: the shape searched through search_options)
        from shardprop.ir.mesh import Mesh
        from shardprop.passes.cost import resolve_cost_model
        from shardprop.passes.pipeline.search import search_pipeline
        costs = dict(pipe["stage_costs"])
        if not a.auto:
            t0 = time.perf_counter()
            shape = sp.plan_step(step, args, mesh=mesh, cost_model=cluster, mode=mode, tokens=a.batch * 2048,
                                 search_options=dict(pp=None, dp=None, tp=[1, 2, 4, 8, 16]))
            print(f"with the marks, the shape searched too: planned in {time.perf_counter() - t0:.1f} s; best "
                  f"{shape.extra['pipeline']['search'].best.describe()}")
            costs.update(shape.extra["pipeline"]["stage_costs"])
        cost = resolve_cost_model(cluster, Mesh(mesh[1], mesh[0]))
        for name, fixed in (("m and schedule for this mesh", dict(pp=8, dp=8, tp=16)),
                            (f"pp x dp x tp x m x schedule (tp in {sorted(costs)})", dict(tp=sorted(costs)))):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                r = search_pipeline(lambda t: costs[t], 1024, a.batch, cost, memory_limit=cost.memory_capacity_bytes,
                                    **fixed)
                times.append(time.perf_counter() - t0)
            times.sort()
            print(f"search alone, {name}: median {times[1]:.2f} s of 3 ({costs[r.best.tp].layers} layers at tp="
                  f"{r.best.tp}; {len(r.ranked)} ranked, {len(r.rejected)} rejected and {r.pruned} pruned); best "
                  f"{r.best.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
