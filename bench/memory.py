"""``memory_limit`` against what XLA allocates: mode="auto" plans of MLP training steps
under limits that bind, their modeled peak beside the compiled program's footprint.

For each case: the plan without a limit, then under each --fractions of that plan's
compiled footprint (what ``memory_analysis()`` adds up: arguments + outputs + temp
- aliased + code). Prints, per plan, the modeled peak, the compiled footprint and its
parts, every memory round (the modeled limit searched under, and what its plan
compiled to), how many ways the parameters and optimizer state are split, and the
seconds plan() took (search and check compiles).

    python bench/memory.py                      # Adam and SGD MLPs, mesh 8
    python bench/memory.py --cases adam --fractions 0.9 0.85
"""
import argparse
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardprop as sp  # noqa: E402


def mlp_loss(params, x, y):
    h = x
    for w in params[:-1]:
        h = jax.nn.relu(h @ w)
    return jnp.mean((h @ params[-1] - y) ** 2)


def adam_step(params, state, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    updates, state = optax.adam(1e-3).update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def sgd_step(params, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    return [p - 0.1 * g for p, g in zip(params, grads)], loss


def data(batch, width, layers=2):
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((width, width)) * 0.05).astype(np.float32) for _ in range(layers)]
    return params, rng.standard_normal((batch, width)).astype(np.float32), \
        rng.standard_normal((batch, width)).astype(np.float32)


def cases(names):
    params, x, y = data(1024, 1024)
    state = optax.adam(1e-3).init(params)
    out = {"adam": (adam_step, (params, state, x, y), ()),
           "adam-donated": (adam_step, (params, state, x, y), (0, 1)),
           "sgd": (sgd_step, data(4096, 1024), ())}
    return {n: out[n] for n in names}


def compiled_total(pstep, args) -> int:
    m = pstep.lower(*args).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
               + m.generated_code_size_in_bytes)


def run(name, fn, args, donate, limit):
    pstep = sp.parallelize(fn, mesh=8, mode="auto", memory_limit=limit, donate_argnums=donate, progress=False)
    t0 = time.perf_counter()
    try:
        plan = pstep.plan(*args)
    except sp.ShardingError as e:
        print(f"{name:<13} limit {limit / 1e6:6.2f} MB: ShardingError ({time.perf_counter() - t0:.1f} s): {e}")
        return None
    seconds = time.perf_counter() - t0
    cost = plan.cost
    compiled = cost.compiled_memory
    total = compiled.total if compiled is not None else compiled_total(pstep, args)
    n_state = len(jax.tree_util.tree_leaves(args[:-2]))
    splits = sorted({plan.graph.mesh.axes_size(v.layout.sharded_axes()) for v in plan.graph.inputs[:n_state]
                     if v.type.rank == 2})
    head = f"limit {limit / 1e6:6.2f} MB" if limit else "no limit      "
    print(f"{name:<13} {head}: modeled {cost.peak_memory / 1e6:6.2f} MB, compiled {total / 1e6:6.2f} MB, "
          f"state split {splits} ways, step {cost.step_time * 1e3:.3f} ms, plan() {seconds:.1f} s")
    if compiled is not None:
        print(f"{'':<13}   compiled {compiled}")
    for k, r in enumerate(cost.memory_checks, start=1):
        print(f"{'':<13}   round {k}: {r}")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["adam", "adam-donated", "sgd"])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.8, 0.7])
    a = ap.parse_args()
    for name, (fn, args, donate) in cases(a.cases).items():
        free = run(name, fn, args, donate, None)
        for f in a.fractions:
            run(name, fn, args, donate, int(free * f))


if __name__ == "__main__":
    main()
