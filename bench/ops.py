"""Plan quality per operator: shardprop's choice against the brute-force best.

For each rule (one jax primitive per case) and random input layouts on a mesh of 8
(``mesh=8``: three axes of 2) and a named 2 x 4 mesh, shardprop plans the op with
its inputs pinned in those layouts and its output free. The same op is then costed
for *every* strategy its factor rule admits (every assignment of mesh axes to its
factors, in every order), each with the redistribution planner's own steps: the
operands moved from their pinned layouts into what the strategy needs, and a
partial result completed the cheapest way (all_reduce, or reduce_scatter onto a
dim), as an unconstrained output is. Both are priced with the same cost model
(collective latency plus bytes over bandwidth, plus the op's compute per device).

    python bench/ops.py [--cases 300] [--seed 0] [--show worse]

Prints a line per case where shardprop is above the brute-force minimum, then the
count of cases at the minimum and the worst ratio, overall and per primitive.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardprop as sp  # noqa: E402
from shardprop.ir.graph import Value, is_collective  # noqa: E402
from shardprop.ir.layout import Layout  # noqa: E402
from shardprop.passes.cost import DEFAULT_COST  # noqa: E402
from shardprop.passes.insert_reshards import InsertReshards  # noqa: E402
from shardprop.passes.redistribute import plan_redistribution  # noqa: E402
from shardprop.passes.rules import rule_for  # noqa: E402
from shardprop.passes.sharding import OpStrategy  # noqa: E402

MESHES = {"8": 8, "2x4": ((2, 4), ("a", "b"))}


# -- the ops --------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    fn: object
    shapes: list          # input shapes
    dtypes: list = None


def op_cases(rng: np.random.Generator) -> list[Case]:
    """One family per rule, with the shapes the issue names among them."""
    i32 = np.int32
    return [
        Case("matmul", lambda a, b: a @ b, [(16, 32), (32, 8)]),
        Case("batched_matmul", lambda a, b: jnp.einsum("abij,abjk->abik", a, b), [(8, 16, 16, 32), (8, 16, 32, 8)]),
        Case("dot_batch", lambda a, b: jnp.einsum("bij,bjk->bik", a, b), [(8, 8, 16), (8, 16, 8)]),
        Case("add", lax.add, [(16, 32), (16, 32)]),
        Case("mul3", lax.mul, [(4, 8, 16), (4, 8, 16)]),
        Case("tanh", lax.tanh, [(16, 32)]),
        Case("reduce_sum", lambda x: jnp.sum(x, axis=1), [(16, 32)]),
        Case("reduce_max", lambda x: jnp.max(x, axis=(0, 2)), [(8, 4, 16)]),
        Case("transpose", lambda x: jnp.transpose(x, (1, 0, 2)), [(8, 4, 16)]),
        Case("reshape_merge", lambda x: x.reshape(32, 16), [(4, 8, 16)]),
        Case("reshape_split", lambda x: x.reshape(4, 8, 16), [(32, 16)]),
        Case("concatenate", lambda a, b: lax.concatenate([a, b], 0), [(8, 16), (16, 16)]),
        Case("concatenate1", lambda a, b: lax.concatenate([a, b], 1), [(16, 8), (16, 16)]),
        Case("gather", _row_gather, [(128, 16), (32, 1)], [np.float32, i32]),
        Case("cumsum", lambda x: lax.cumsum(x, axis=1), [(16, 32)]),
        Case("slice", lambda x: lax.slice(x, (0, 8), (16, 24)), [(16, 32)]),
        Case("pad", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (1, 3, 0))), [(16, 32)]),
        Case("broadcast", lambda x: lax.broadcast_in_dim(x, (8, 16, 32), (1, 2)), [(16, 32)]),
    ]


def _row_gather(table, ids):
    """An embedding lookup as the one primitive it is (jnp.take adds index arithmetic)."""
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return lax.gather(table, ids, dnums, (1, table.shape[1]), mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def random_layout(shape, mesh_names, mesh_sizes, rng) -> tuple:
    """Each mesh axis goes to a random dim it still divides, or nowhere."""
    dims = [[] for _ in shape]
    left = list(shape)
    for a, n in zip(mesh_names, mesh_sizes):
        options = [d for d in range(len(shape)) if left[d] % n == 0] + [None]
        d = options[rng.integers(len(options))]
        if d is not None:
            dims[d].append(a)
            left[d] //= n
    return tuple(tuple(d) for d in dims)


def as_strategy(dims, mesh_spec, ir_names, sizes):
    """The user's form of a layout: a PartitionSpec (named mesh) or split counts (mesh=8)."""
    if isinstance(mesh_spec, int):
        size = dict(zip(ir_names, sizes))
        return tuple(math.prod(size[a] for a in d) for d in dims)
    return P(*[d if len(d) > 1 else (d[0] if d else None) for d in dims])


# -- costing one strategy --------------------------------------------------------------
def _steps(shape, itemsize, src, dst, mesh):
    return plan_redistribution(tuple(shape), itemsize, src, dst, mesh, True, DEFAULT_COST)


def strategy_cost(op, st: OpStrategy, in_layouts, mesh, cost=DEFAULT_COST):
    """(modeled seconds, bytes) of running ``op`` with ``st`` given its operands' layouts."""
    seconds, nbytes = 0.0, 0.0
    for n, v in enumerate(op.inputs):
        if v.is_literal:
            continue
        need = st.operand_layout(n, v.type.rank, mesh)
        steps = _steps(v.type.shape, v.type.itemsize, in_layouts[n], need, mesh)
        nbytes += sum(s.wire_bytes for s in steps)
        seconds += cost.move_time(steps, mesh)   # a profile prices each step's own device group
    for k, v in enumerate(op.outputs):
        have = st.result_layout(k, mesh)
        if have.partial:
            probe = Value(v.type, layout=have)
            done = InsertReshards(True, cost).output_layout(probe, mesh)
            steps = _steps(v.type.shape, v.type.itemsize, have, done, mesh)
            nbytes += sum(s.wire_bytes for s in steps)
            seconds += cost.move_time(steps, mesh)
    degree = math.prod(mesh.axes_size(a) for a in st.factors if a)
    touched = sum(v.type.nbytes for v in itertools.chain(op.inputs, op.outputs))
    compute = cost.compute_time(st.rule.flops / degree, touched / degree)
    return seconds + compute, nbytes, seconds


def all_strategies(rule, mesh):
    """Every assignment of mesh axes (each to one factor or none, in every order)."""
    axes = mesh.axis_names
    nf = rule.num_factors
    for choice in itertools.product(range(nf + 1), repeat=len(axes)):
        groups = [[a for a, c in zip(axes, choice) if c == f] for f in range(nf)]
        for orders in itertools.product(*[itertools.permutations(g) for g in groups]):
            factors = tuple(tuple(o) for o in orders)
            st = OpStrategy(rule, factors)
            if st.problems(mesh):
                continue
            try:   # a split that would make a merged dim's blocks non-contiguous is no strategy
                for n, fs in enumerate(rule.operands):
                    if fs is not None:
                        st.operand_layout(n, len(fs), mesh)
                for k in range(len(rule.results)):
                    st.result_layout(k, mesh)
            except ValueError:
                continue
            yield st


# -- one case ---------------------------------------------------------------------------
def run_case(case: Case, mesh_name: str, rng) -> dict:
    mesh_spec = MESHES[mesh_name]
    dtypes = case.dtypes or [np.float32] * len(case.shapes)
    args = []
    for shape, dt in zip(case.shapes, dtypes):
        if np.issubdtype(dt, np.integer):
            args.append(rng.integers(0, 128, size=shape).astype(dt))
        else:
            args.append(rng.standard_normal(shape).astype(dt))
    ir_mesh = sp.parallelize(lambda *a: a[0], mesh=mesh_spec).mesh_spec.ir_mesh
    names, sizes = ir_mesh.axis_names, ir_mesh.axis_sizes
    dims = [random_layout(a.shape, names, sizes, rng) for a in args]
    strategy = tuple(as_strategy(d, mesh_spec, names, sizes) for d in dims)
    pf = sp.parallelize(case.fn, mesh=mesh_spec, in_strategy=strategy, progress=False)
    plan = pf.plan(*args)
    graph, mesh = plan.graph, plan.mesh
    ops = [op for op in graph.ops if not is_collective(op)]
    if len(ops) != 1:
        return dict(skip=f"{len(ops)} ops: {[o.kind for o in ops]}")
    op = ops[0]
    # operands are graph inputs here (one op); map each operand to its input's pinned layout
    pinned = {id(v): v.layout for v in graph.inputs}
    src = []
    for v in op.inputs:
        src.append(pinned.get(id(v)) if id(v) in pinned else _pinned_source(v, graph))
    ours = strategy_cost(op, op.strategy, src, mesh)
    best, best_bytes, best_comm = None, math.inf, math.inf
    for st in all_strategies(rule_for(op), mesh):
        c = strategy_cost(op, st, src, mesh)
        if best is None or c[0] < best[0][0] - 1e-15:
            best = (c, st)
        best_bytes = min(best_bytes, c[1])
        best_comm = min(best_comm, c[2])
    return dict(primitive=op.kind, ours_s=ours[0], ours_model_bytes=ours[1], plan_bytes=plan.bytes,
                ours_comm=ours[2], best_comm=best_comm,
                best_s=best[0][0], best_bytes_at_best=best[0][1], min_bytes=best_bytes,
                ours_strategy=op.strategy.factors, best_strategy=best[1].factors,
                layouts=[str(l) for l in src])


def _pinned_source(v, graph):
    """An operand that is not a graph input directly (a redistribution sits between):
    follow back to the input it was made from."""
    for op in graph.ops:
        if v in op.outputs and is_collective(op):
            return _pinned_source(op.inputs[0], graph) if op.inputs[0] not in graph.inputs else op.inputs[0].layout
    if v.type.rank == 0:
        return Layout(())       # a scalar constant (pad's padding value): on every device
    raise LookupError("operand not traced back to an input")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=300, help="random cases in all (spread over ops and meshes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", choices=("worse", "all", "none"), default="worse")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    cases = op_cases(rng)
    results, skipped = [], []
    combos = [(c, m) for c in cases for m in MESHES]
    for i in range(args.cases):
        case, mesh_name = combos[i % len(combos)]
        r = run_case(case, mesh_name, rng)
        if "skip" in r:
            skipped.append((case.name, r["skip"]))
            continue
        r.update(case=case.name, mesh=mesh_name)
        results.append(r)
        ratio = r["ours_s"] / r["best_s"] if r["best_s"] > 0 else 1.0
        r["ratio"] = ratio
        if args.show == "all" or args.show == "worse" and r["ours_comm"] > r["best_comm"] * (1 + 1e-9):
            print(f"{case.name:<15} mesh {mesh_name:<4} in {r['layouts']}: ours {r['ours_s'] * 1e6:8.2f}us "
                  f"{r['ours_model_bytes']:9.0f}B  best {r['best_s'] * 1e6:8.2f}us {r['best_bytes_at_best']:9.0f}B  "
                  f"x{ratio:.2f}  ours={r['ours_strategy']} best={r['best_strategy']}")
    at_min = sum(1 for r in results if r["ratio"] <= 1 + 1e-9)
    worst = max(results, key=lambda r: r["ratio"])
    print(f"\n{len(results)} cases: shardprop at the brute-force minimum (modeled time) in {at_min} "
          f"({100 * at_min / len(results):.1f}%); worst ratio {worst['ratio']:.2f} ({worst['case']}, mesh {worst['mesh']})")
    for r in results:
        r["comm_ratio"] = r["ours_comm"] / r["best_comm"] if r["best_comm"] > 0 else (1.0 if r["ours_comm"] == 0
                                                                                        else math.inf)
    comm_min = sum(1 for r in results if r["ours_comm"] <= r["best_comm"] * (1 + 1e-9))
    worst_c = max(results, key=lambda r: r["comm_ratio"])
    print(f"communication alone (collective latency + bytes, no compute): at the minimum in {comm_min} "
          f"({100 * comm_min / len(results):.1f}%); worst ratio {worst_c['comm_ratio']:.2f} ({worst_c['case']}, "
          f"mesh {worst_c['mesh']})")
    per = defaultdict(list)
    for r in results:
        per[r["case"]].append(r)
    print(f"\n{'case':<15} {'cases':>5} {'at min':>6} {'worst':>6} {'comm at min':>11} {'bytes ours/best':>16}")
    for name, rs in per.items():
        ob = sum(r["ours_model_bytes"] for r in rs)
        bb = sum(r["best_bytes_at_best"] for r in rs)
        comm = sum(r["ours_comm"] <= r["best_comm"] * (1 + 1e-9) for r in rs)
        print(f"{name:<15} {len(rs):>5} {sum(r['ratio'] <= 1 + 1e-9 for r in rs):>6} "
              f"{max(r['ratio'] for r in rs):>6.2f} {comm:>11} {ob / bb if bb else 1.0:>16.2f}")
    mismatch = [r for r in results if abs(r["plan_bytes"] - r["ours_model_bytes"]) > 0.5]
    if mismatch:
        print(f"\nnote: {len(mismatch)} cases where the plan's collectives move other bytes than its strategy "
              "costed alone (a redistribution the compiler plans differently)")
    if skipped:
        print(f"skipped {len(skipped)}: {sorted(set(skipped))[:5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
