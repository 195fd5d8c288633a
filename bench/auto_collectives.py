"""The collectives auto's plans under a limit run, and what one such collective costs
here against the profile's price.

For ``gpt2_train_dp2xmp4`` (zoo): the compiled programs' collectives (kind, bytes, count;
``bench/hlo.py``) of auto's plan at each limit (a fraction of the free plan's modeled
peak) and of the case's marks. Then single collectives on the forced devices, over all
of them and over the model axis: all_reduce, reduce_scatter and all_gather of 128 KB,
512 KB and 2 MB. Each is timed as 16 in a chain, each after an elementwise op (so each
waits for the group, as in a step), as the median of 15 calls, less the same chain
without the collectives. It prints each beside ``CostModel.collective_time`` for a
collective at the step's end (1 rider). A reduce-scatter's chain also tiles its result
back to full size (one local copy).

    python bench/auto_collectives.py --cost-model bench/results/h200-2026-11-27/cpu16.json
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench import zoo  # noqa: E402
from bench.compare import fresh  # noqa: E402
from bench.hlo import collectives  # noqa: E402
import shardprop as sp  # noqa: E402
from shardprop.ir.mesh import Mesh as IRMesh  # noqa: E402
from shardprop.passes.cost import wire_bytes  # noqa: E402

CHAIN, REPS = 16, 15
SIZES = (131072, 524288, 2097152)   # bytes of the local buffer (all_gather: of its result)


def program_collectives(name, pf, args) -> None:
    a = jax.tree_util.tree_map(np.array, args)
    pf.plan(*a)
    text = pf.lower(*a).compile().as_text()
    c = collectives(text, 8)
    print(f"{name}: {dict(c.counts)}, {c.bytes / 1e6:.2f} MB per device")
    for (kind, nbytes, _), n in sorted(collections.Counter(c.ops).items()):
        print(f"    {n} x {kind} of {nbytes:,} bytes")


def median_call(f, x) -> float:
    f(x).block_until_ready()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chain(kind: str, axes: tuple, n: int, rows: int):
    def body(x):
        y = x
        for _ in range(CHAIN):
            y = y * 1.0001 + 0.5
            if kind == "all_reduce":
                y = jax.lax.psum(y, axes)
            elif kind == "reduce_scatter":
                y = jnp.tile(jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True), (n, 1))
            elif kind == "all_gather":
                y = jax.lax.all_gather(y[: rows // n], axes, axis=0, tiled=True)
        return y
    return body


def single_collectives(mesh, cost) -> None:
    ir_mesh = IRMesh(tuple(mesh.axis_names), tuple(mesh.devices.shape))
    for axes in (tuple(mesh.axis_names), tuple(mesh.axis_names[1:])):
        n = int(np.prod([mesh.shape[a] for a in axes]))
        for nbytes in SIZES:
            rows = nbytes // 4 // 128
            x = jnp.ones((rows, 128), jnp.float32)
            timed = {}
            for kind in ("none", "all_reduce", "reduce_scatter", "all_gather"):
                f = jax.jit(jax.shard_map(chain(kind, axes, n, rows), mesh=mesh, in_specs=P(), out_specs=P(),
                                          check_vma=False))
                timed[kind] = median_call(f, x)
            for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                local = nbytes // n if kind == "all_gather" else nbytes
                model = cost.collective_time(wire_bytes(kind, local, n), kind, axes, ir_mesh)
                print(f"{kind:<15} over {','.join(axes):<6} {nbytes // 1024:5d} KB: "
                      f"{(timed[kind] - timed['none']) / CHAIN * 1e6:8.1f} us each (model {model * 1e6:7.1f} us)",
                      flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost-model", default="cpu", help="a built-in profile name or a `shardprop calibrate` file")
    ap.add_argument("--limits", default="0.7,0.9", help="fractions of the free plan's modeled peak")
    a = ap.parse_args()
    cost_model = a.cost_model if a.cost_model in ("cpu", "h100") else sp.CostModel.load(a.cost_model)
    case = next(c for c in zoo.cases() if c.name == "gpt2_train_dp2xmp4")
    shape, names = case.mesh
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
    args = case.args()
    zoo.annotate.mode = "plain"
    free = sp.parallelize(fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums,
                          progress=False, cost_model=cost_model).plan(*jax.tree_util.tree_map(np.array, args))
    for frac in [float(f) for f in a.limits.split(",") if f]:
        zoo.annotate.mode = "plain"
        program_collectives(f"auto at {frac}", sp.parallelize(
            fresh(case.fn), mesh=mesh, mode="auto", donate_argnums=case.state_argnums, progress=False,
            cost_model=cost_model, memory_limit=int(frac * free.cost.peak_memory)), args)
    zoo.annotate.mode, zoo.annotate.mesh = "shardprop", mesh
    program_collectives("marks", sp.parallelize(fresh(case.fn), mesh=mesh, donate_argnums=case.state_argnums,
                                                progress=False, cost_model=cost_model), args)
    pf = sp.parallelize(fresh(case.fn), mesh=mesh, progress=False, cost_model=cost_model)
    single_collectives(mesh, pf.options.cost)


if __name__ == "__main__":
    main()
