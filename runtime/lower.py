"""Lowering: the localized per-rank program becomes one ``jax.jit(jax.shard_map(...))``.

Each op is replayed inside the shard_map body on local blocks: jax primitives
are bound with their localized params; collectives map to ``lax.psum`` /
``pmax`` / ``pmin``, ``psum_scatter``, ``all_gather``, ``all_to_all``,
``ppermute``; slices cut at ``axis_index`` offsets. What runs is exactly the
program the per-rank dumps show.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ..ir.graph import Graph, Op, Value, is_collective
from ..ir.layout import Layout
from ..passes.rules.indexing import lookup_dims as lookup_rows
from ..passes.rules.indexing import scatter_rows
from ..passes.rules.random import blockwise_bits
from .random_bits import random_bits_block


def partition_spec(layout: Layout) -> PartitionSpec:
    return PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in layout.dims])


def _axis_offset(axes: Sequence[str], block: int):
    # int32 throughout: dynamic_slice wants one index type, and under jax_enable_x64 a
    # Python 0 would become int64 beside axis_index's int32
    return lax.axis_index(tuple(axes)) * np.int32(block) if axes else np.int32(0)


def _run_collective(op: Op, x, mesh_axes: tuple):
    p = op.params
    k = op.kind
    if k == "all_reduce":
        fn = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[p["op"]]
        return fn(x, tuple(p["axes"]))
    if k == "reduce_scatter":
        return lax.psum_scatter(x, tuple(p["axes"]), scatter_dimension=p["dim"], tiled=True)
    if k == "all_gather":
        return lax.all_gather(x, tuple(p["axes"]), axis=p["dim"], tiled=True)
    if k == "all_to_all":
        return _all_to_all(x, tuple(p["axes"]), split_dim=p["dst_dim"], concat_dim=p["src_dim"])
    if k == "slice":
        out = op.outputs[0].local_type.shape
        starts = [np.int32(0)] * x.ndim
        for d, axes in p["cuts"]:
            starts[d] = _axis_offset(axes, out[d])
        return lax.dynamic_slice(x, starts, out)
    if k == "permute":
        # pairs are global ranks, i.e. linear indices over all mesh axes in order
        return lax.ppermute(x, mesh_axes, perm=list(p["pairs"]))
    raise NotImplementedError(k)


def _all_to_all(x, axes: tuple, split_dim: int, concat_dim: int):
    """A tiled all_to_all in a canonical form: the chunks travel along a new leading
    dim. XLA's CPU verifier rejects some all_to_alls whose split and concat dims sit
    between size-1 dims (its layout assignment gives the operands different layouts);
    exchanging whole leading chunks has one obvious layout."""
    n = lax.axis_size(axes)
    shape = x.shape
    chunked = x.reshape(shape[:split_dim] + (n, shape[split_dim] // n) + shape[split_dim + 1:])
    chunked = jnp.moveaxis(chunked, split_dim, 0)
    received = lax.all_to_all(chunked, axes, split_axis=0, concat_axis=0, tiled=True)
    # received[j] came from the j-th device of the group: it goes j-th along concat_dim
    local = list(shape)
    local[split_dim] //= n
    received = jnp.moveaxis(received, 0, concat_dim)
    local[concat_dim] *= n
    return received.reshape(local)


def _reduced_axes(op: Op) -> tuple:
    st = op.strategy
    return tuple(a for f in st.rule.reduction for a in st.factors[f])


def _run_primitive(op: Op, args: list):
    params = op.local_params
    if op.strategy is None:
        # per-device code of a user's shard_map: no layout to adapt it to, bound as written
        out = op.prim.bind(*args, **params)
        return list(out) if op.prim.multiple_results else [out]
    axes = _reduced_axes(op) if op.kind in ("scatter-add", "scatter_add") else ()
    if axes:
        # Updates split over some axes: every device adds its share into the table and
        # the result is a partial sum. The table itself must be counted once, so all
        # devices but the first of each group start from zeros.
        first = lax.axis_index(axes) == 0
        args = [jnp.where(first, args[0], jnp.zeros_like(args[0]))] + list(args[1:])
    if op.kind == "gather" and _reduced_axes(op):
        return [_vocab_parallel_gather(op, args, params)]
    if op.kind in ("scatter-add", "scatter_add") and any(op.inputs[0].layout.dims[d] for d in scatter_rows(op)):
        args = _owned_scatter_args(op, args, params)
    if op.kind == "random_bits" and _draws_block(op):
        # each device draws only its block of the global bits (runtime/random_bits.py)
        v, key_rank = op.outputs[0], op.inputs[0].type.rank
        block = v.local_type.shape[key_rank:]
        offsets = [_axis_offset(axes, n) for axes, n in zip(v.layout.dims[key_rank:], block)]
        return [random_bits_block(args[0], params["bit_width"], op.params["shape"], block, offsets)]
    if op.kind == "iota":
        out = op.prim.bind(**params)
        axes = op.outputs[0].layout.dims[params["dimension"]]
        if axes:
            local = op.outputs[0].local_type.shape[params["dimension"]]
            out = out + lax.convert_element_type(_axis_offset(axes, local), out.dtype)
        return [out]
    out = op.prim.bind(*args, **params)
    return list(out) if op.prim.multiple_results else [out]


def _vocab_parallel_gather(op: Op, args: list, params: dict):
    """A lookup in a table split by rows (Megatron's vocab-parallel embedding): each
    device looks up the ids it owns, shifted into its block, and zeros elsewhere; the
    result is a partial sum over the row axes that the plan completes. An id no device
    owns (out of range) takes the gather's fill value, once per group."""
    table, ids = args[0], args[1]
    dn = params["dimension_numbers"]
    layout = op.inputs[0].layout
    owned = jnp.ones(ids.shape[:-1], bool)
    valid = jnp.ones(ids.shape[:-1], bool)
    shifted = ids
    first = True
    for d in lookup_rows(op):
        j = dn.start_index_map.index(d)
        full, local = op.inputs[0].type.shape[d], table.shape[d]
        i = ids[..., j]
        if params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:
            i = jnp.clip(i, 0, full - 1)   # CLIP, and what XLA does with a broken promise of in-bounds ids
        valid &= (i >= 0) & (i < full)
        i = i - _axis_offset(layout.dims[d], local)
        owned &= (i >= 0) & (i < local)
        shifted = shifted.at[..., j].set(jnp.clip(i, 0, local - 1))
        if layout.dims[d]:
            first = first & (lax.axis_index(tuple(layout.dims[d])) == 0)
    out = op.prim.bind(table, shifted, **{**params, "mode": lax.GatherScatterMode.CLIP})
    batch = [k for k in range(out.ndim) if k not in dn.offset_dims]   # the ids' dims in the output
    expand = lambda m: lax.broadcast_in_dim(m, out.shape, tuple(batch))  # noqa: E731
    out = jnp.where(expand(owned), out, jnp.zeros_like(out))
    if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        fill = jnp.asarray(_fill_value(params.get("fill_value"), out.dtype), out.dtype)
        out = jnp.where(expand(~valid & first), fill, out)
    return out


def _owned_scatter_args(op: Op, args: list, params: dict) -> list:
    """A scatter-add into a table split by rows (the vocab-parallel lookup's gradient):
    ids are shifted into this device's block, and the updates of ids it does not own
    become zeros added at a clamped row. A CLIP scatter clamps the global id first;
    otherwise an id out of range is owned by nobody, so dropped, as jax drops it."""
    table, ids, updates = args[:3]
    dn = params["dimension_numbers"]
    layout = op.inputs[0].layout
    owned = jnp.ones(ids.shape[:-1], bool)
    shifted = ids
    for d in scatter_rows(op):
        j = dn.scatter_dims_to_operand_dims.index(d)
        full, local = op.inputs[0].type.shape[d], table.shape[d]
        i = ids[..., j]
        if params["mode"] == lax.GatherScatterMode.CLIP:
            i = jnp.clip(i, 0, full - 1)
        i = i - _axis_offset(layout.dims[d], local)
        owned &= (i >= 0) & (i < local)
        shifted = shifted.at[..., j].set(jnp.clip(i, 0, local - 1))
    scatter_dims = [k for k in range(updates.ndim) if k not in dn.update_window_dims]
    keep = lax.broadcast_in_dim(owned, updates.shape, tuple(scatter_dims))
    return [table, shifted, jnp.where(keep, updates, jnp.zeros_like(updates))] + list(args[3:])


def _fill_value(fill, dtype):
    """What jax's gather fills an out-of-range lookup with (its defaults when None)."""
    if fill is not None:
        return fill
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.nan
    info = jnp.iinfo(dtype)
    return info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max


def _draws_block(op: Op) -> bool:
    """A random_bits whose drawn dims are split (its rule allows that only for counter-based bits)."""
    return blockwise_bits(op) and any(op.outputs[0].layout.dims[op.inputs[0].type.rank:])


def _read(env: dict, v: Value):
    if v.is_literal:
        return np.asarray(v.literal)
    return env[v.id]


def run_graph(graph: Graph, args: Sequence) -> list:
    """Replay a localized graph on local blocks (inside shard_map)."""
    env = {v.id: x for v, x in zip(graph.inputs, args)}
    # a user's shard_map body has no mesh of its own, and holds no planned collective
    axes = graph.mesh.axis_names if graph.mesh is not None else ()
    waits = _tie_waits(graph)
    for op in graph.ops:
        if op in waits:
            outs = [_run_gather_tie(_read(env, op.inputs[0]), [_read(env, v) for v in waits[op]])]
        else:
            outs = run_op(op, [_read(env, v) for v in op.inputs], axes)
        for v, x in zip(op.outputs, outs):
            env[v.id] = x
    return [_read(env, v) for v in graph.outputs]


def run_op(op: Op, ins: list, mesh_axes: tuple) -> list:
    """One op of a localized graph on local blocks (inside shard_map): its outputs. The
    pipeline (runtime/pipeline_lower.py) replays a graph op by op with this."""
    if is_collective(op):
        return [_run_collective(op, ins[0], mesh_axes)]
    if op.kind in _CONTROL_FLOW:
        return _CONTROL_FLOW[op.kind](op, ins)
    if op.kind == GATHER_TIE:    # (replayed without the graph around it: no activation to wait for)
        return list(ins)
    return _run_primitive(op, ins)


GATHER_TIE = "gather_tie"     # passes/insert_reshards.py TIE


def _tie_waits(graph: Graph) -> dict:
    """For each tie of a stored value's gather (passes/insert_reshards.py ``TIE``):
    what the use its gather serves reads besides, each as the value it is
    redistributed from that exists where the tie runs (a use that reads nothing
    else: the last value computed before the tie). The use is found by following
    the tie's result through the redistributions (the gather) to the first op
    that computes with it.

    Where the use the previous tie served reads what this use reads (attention's query,
    key and value projections of one activation), the tie waits for that use's result
    too, so the two gathers run one use after the other, each gathered weight alive
    while its use runs, as the memory model counts it (passes/auto/memory.py). Waiting
    only on the shared activation, all three gathers ran as soon as it was ready, their
    weights alive together: zoo's megatron_attention compiled 0.82 MB of scratch against
    0.56 MB modeled, under a limit of 0.57 MB. (Not for every pair of consecutive uses:
    a wait on a use that is not a sibling kept its result alive until the tie ran, and
    the tp+FSDP GPT steps' compiled peaks rose 0.13 MB.)"""
    ties = [t for t, op in enumerate(graph.ops) if op.kind == GATHER_TIE]
    if not ties:
        return {}
    made, readers = {}, {}
    for t, op in enumerate(graph.ops):
        for v in op.outputs:
            made[v.id] = (t, op)
        for v in op.inputs:
            readers.setdefault(v.id, []).append(op)
    out = {}
    previous_use = None
    for t in ties:
        tie = graph.ops[t]
        chain, use = {tie.outputs[0].id}, None
        at = tie.outputs[0]
        while use is None and readers.get(at.id):
            nxt = readers[at.id][0]
            if is_collective(nxt):
                at = nxt.outputs[0]
                chain.add(at.id)
            else:
                use = nxt
        waits = []
        for v in (use.inputs if use is not None else ()):
            if v.id in chain or v.literal is not None:
                continue
            while v.id in made and made[v.id][0] > t and is_collective(made[v.id][1]):
                v = made[v.id][1].inputs[0]
            if v.id not in made or made[v.id][0] < t:
                waits.append(v)
        if previous_use is not None and previous_use.outputs and made[previous_use.outputs[0].id][0] < t and \
                any(v in previous_use.inputs for v in waits):
            waits += [v for v in previous_use.outputs if v.literal is None][:1]
        if not waits:
            waits = [v for op in reversed(graph.ops[:t]) if op.kind != GATHER_TIE and not is_collective(op)
                     for v in op.outputs if v.literal is None][:1]
        out[tie] = waits
        previous_use = use if use is not None else previous_use
    return out


def _run_gather_tie(stored, waits: list):
    """A gather's tie: ``stored`` (the split of a parameter about to be gathered) unchanged,
    through a select on a test of ``waits`` (what the gather's use reads besides)
    that is never true, so the gather depends on them. XLA then neither runs it at
    the program's start nor merges it with another gather of the same parameter
    (XLA:CPU turns an ``optimization_barrier`` into nothing before it schedules: no
    dependence would be left)."""
    never = jnp.zeros((), bool)
    for x in waits:
        if not (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_):   # a PRNG key: nothing to compare
            continue
        first = jnp.reshape(x, (-1,))[0] if x.size else jnp.zeros((), jnp.float32)
        # a float of any value, NaN included, is never above +inf
        never = never | (lax.convert_element_type(jnp.real(first), jnp.float32) > np.float32(np.inf))
    return jnp.where(never, jnp.zeros_like(stored), stored)


def _run_scan(op: Op, args: list) -> list:
    body = op.subgraphs[0]
    p = op.local_params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:nc], args[nc:nc + ncarry], args[nc + ncarry:]

    def step(carry, x):
        outs = run_graph(body, list(consts) + list(carry) + list(x))
        return tuple(outs[:ncarry]), tuple(outs[ncarry:])
    carry, ys = lax.scan(step, tuple(init), tuple(xs), length=p["length"], reverse=p["reverse"],
                         unroll=p.get("unroll", 1))
    return list(carry) + list(ys)


def _run_while(op: Op, args: list) -> list:
    cond, body = op.subgraphs
    nc, nb = op.params["cond_nconsts"], op.params["body_nconsts"]
    cconsts, bconsts, init = args[:nc], args[nc:nc + nb], args[nc + nb:]
    out = lax.while_loop(lambda c: run_graph(cond, list(cconsts) + list(c))[0],
                         lambda c: tuple(run_graph(body, list(bconsts) + list(c))), tuple(init))
    return list(out)


def _run_cond(op: Op, args: list) -> list:
    branches = [lambda *a, g=g: tuple(run_graph(g, list(a))) for g in op.subgraphs]
    return list(lax.switch(args[0], branches, *args[1:]))


def _run_shard_map(op: Op, args: list) -> list:
    """A user's shard_map: the program already runs per device (inside one shard_map over
    the whole mesh), so its body runs right here on the blocks its in_specs give."""
    return run_graph(op.params["body"], args)


_CONTROL_FLOW = {"scan": _run_scan, "while": _run_while, "cond": _run_cond, "shard_map": _run_shard_map}


def build_body(graph: Graph) -> Callable:
    def body(*local_inputs):
        return tuple(run_graph(graph, local_inputs))
    return body


def lower(graph: Graph, jax_mesh, donate: Sequence[int] = ()) -> Callable:
    """A jitted function of the graph's global inputs returning its global outputs."""
    in_specs = tuple(partition_spec(v.layout) for v in graph.inputs)
    out_specs = tuple(partition_spec(v.layout) for v in graph.outputs)
    mapped = jax.shard_map(build_body(graph), mesh=jax_mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)
    in_shardings = tuple(NamedSharding(jax_mesh, s) for s in in_specs)
    out_shardings = tuple(NamedSharding(jax_mesh, s) for s in out_specs)
    return jax.jit(mapped, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=tuple(donate))
