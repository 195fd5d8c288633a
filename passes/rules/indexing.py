"""Indexing: gather (embedding lookups), scatter-add (their gradients),
dynamic_slice and dynamic_update_slice.

Indexed dims stay whole (a device cannot look up a row another device holds
without communication), except a table's rows looked up or written one id at a
time: a gather splits them as a reduction (vocab-parallel lookup), a scatter-add
writes only the rows it owns. Dims taken whole by every slice may stay split, and so
may the batch dims of the indices: an embedding table split on its hidden dim,
looked up with tokens split on the batch, needs no collective. A scatter-add
with its updates split on the batch leaves a partial sum, combined later.
"""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, numel, register, register_localizer


def _whole(fb, size, need):
    if size == 1:
        return ()
    f = fb.new(size)
    need.add(f)
    return (f,)


def _indexed(operand, indices, windowed, window_dims, collapsed, index_map, operand_batching, indices_batching,
             slice_size):
    """Factors shared by gather and scatter: the indices' batch dims are the windowed
    tensor's (gather output / scatter updates) other dims; an operand dim taken whole by
    every window is shared with its window dim; indexed dims and the index vector stay
    whole; operand batching dims follow the indices'. Returns the factors and the
    factors of the indices' batch dims."""
    fb = FactorBuilder()
    need: set = set()
    op_f: list = [()] * len(operand)
    idx_f: list = [()] * len(indices)
    win_f: list = [()] * len(windowed)
    batch = []
    for i, w in zip(range(len(indices) - 1), [d for d in range(len(windowed)) if d not in window_dims]):
        f = (fb.new(indices[i]),) if indices[i] != 1 else ()
        idx_f[i] = win_f[w] = f
        batch.append(f)
    idx_f[-1] = _whole(fb, indices[-1], need)
    for od, idd in zip(operand_batching, indices_batching):
        op_f[od] = idx_f[idd]
    window = [d for d in range(len(operand)) if d not in collapsed and d not in operand_batching]
    for d, w in zip(window, window_dims):
        if d not in index_map and slice_size(d, w) == operand[d]:
            f = (fb.new(operand[d]),) if operand[d] != 1 else ()
            op_f[d] = win_f[w] = f
        else:
            op_f[d] = _whole(fb, operand[d], need)
            win_f[w] = _whole(fb, windowed[w], need)
    for d in range(len(operand)):
        if d not in window and d not in operand_batching:
            op_f[d] = _whole(fb, operand[d], need)   # collapsed (indexed) dims
    return fb, need, tuple(op_f), tuple(idx_f), tuple(win_f), batch


def lookup_dims(op) -> tuple:
    """Operand dims of a gather that are looked up one entry at a time (an embedding
    table's rows): collapsed, indexed, slice size 1. Split, they are the vocab-parallel
    lookup's reduction: each device looks up the rows it owns and contributes zeros
    for the others, and the partial sums add up to the lookup (runtime/lower.py)."""
    dn = op.params["dimension_numbers"]
    if op.inputs[0].type.dtype == "bool" or dn.operand_batching_dims:
        return ()
    rows = tuple(d for d in dn.collapsed_slice_dims if d in dn.start_index_map and op.params["slice_sizes"][d] == 1)
    # every indexed dim a lookup dim: then an id out of range is out of range in one of them
    return rows if set(rows) == set(dn.start_index_map) else ()


@register("gather")
def gather_rule(op) -> FactorRule:
    dn = op.params["dimension_numbers"]
    operand, indices = op.inputs[0].type.shape, op.inputs[1].type.shape
    out = op.outputs[0].type.shape
    sizes = op.params["slice_sizes"]
    fb, need, op_f, idx_f, out_f, _ = _indexed(
        operand, indices, out, dn.offset_dims, dn.collapsed_slice_dims, dn.start_index_map,
        dn.operand_batching_dims, dn.start_indices_batching_dims, lambda d, w: sizes[d])
    rows = {f for d in lookup_dims(op) for f in op_f[d]}
    return FactorRule(tuple(fb.sizes), (op_f, idx_f), (out_f,), reduction=frozenset(rows), reduce_op="sum",
                      need_replication=frozenset(need - rows), flops=numel(out))


@register_localizer("gather")
def _gather_local(op, in_shapes, out_shapes):
    operand = op.inputs[0].type.shape
    sizes = tuple(local if s == full else s for s, full, local in
                  zip(op.params["slice_sizes"], operand, in_shapes[0]))
    return {**op.params, "slice_sizes": sizes}


def scatter_rows(op) -> tuple:
    """Operand dims of a scatter that are written one entry per index (an embedding
    table's rows, in the gradient of a lookup): inserted, indexed. Split, each device
    adds only the updates whose ids it owns, shifted into its block (the transpose of
    the vocab-parallel lookup): the table stays split by rows, nothing table-sized
    moves (runtime/lower.py)."""
    dn = op.params["dimension_numbers"]
    if op.inputs[0].type.dtype == "bool" or dn.operand_batching_dims:
        return ()
    rows = tuple(d for d in dn.inserted_window_dims if d in dn.scatter_dims_to_operand_dims)
    return rows if set(rows) == set(dn.scatter_dims_to_operand_dims) else ()


@register("scatter-add", "scatter_add")
def scatter_add_rule(op) -> FactorRule:
    """operand + scatter(updates). The updates' scatter dims (rows added into the
    table) are reduction factors: split, each device adds its share and the result
    is a partial sum (the lowering zeroes the operand on all but one device of the
    group, so it is counted once). The operand's written rows may be split too
    (``scatter_rows``): then the updates are whole over those axes and each device
    keeps the ones it owns."""
    fb, need, op_f, idx_f, upd_f, rows = _scatter_factors(op)
    owned = {f for d in scatter_rows(op) for f in op_f[d]}
    return FactorRule(tuple(fb.sizes), (op_f, idx_f, upd_f), (op_f,),
                      reduction=frozenset(rows), reduce_op="sum", need_replication=frozenset(need - owned),
                      linear=(((0, 2), "sum"),), flops=numel(op.inputs[2].type.shape))


def _scatter_factors(op):
    """Factors of a scatter, and the updates' row factors (scattered into the operand;
    a batching dim is matched, not scattered)."""
    dn = op.params["dimension_numbers"]
    operand, indices, updates = (v.type.shape for v in op.inputs[:3])
    fb, need, op_f, idx_f, upd_f, batch = _indexed(
        operand, indices, updates, dn.update_window_dims, dn.inserted_window_dims, dn.scatter_dims_to_operand_dims,
        dn.operand_batching_dims, dn.scatter_indices_batching_dims, lambda d, u: updates[u])
    matched = {f for idd in dn.scatter_indices_batching_dims for f in idx_f[idd]}
    return fb, need, op_f, idx_f, upd_f, {f for fs in batch for f in fs} - matched


@register("scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max")
def scatter_rule(op) -> FactorRule:
    """operand with rows overwritten (or multiplied, or min/max-ed) by updates. Unlike
    an add, shares of the updates applied on different devices cannot be combined
    afterwards, so the updates' scatter dims stay whole; the window dims taken whole
    may stay split, shared with the operand's."""
    fb, need, op_f, idx_f, upd_f, rows = _scatter_factors(op)
    return FactorRule(tuple(fb.sizes), (op_f, idx_f, upd_f), (op_f,), need_replication=frozenset(need | rows),
                      flops=numel(op.inputs[2].type.shape))


def _sliced(operand_shape, slice_shape):
    """dynamic_slice / dynamic_update_slice: dims taken whole are shared, others whole."""
    fb = FactorBuilder()
    need: set = set()
    op_f, sl_f = [], []
    for n, s in zip(operand_shape, slice_shape):
        if n == s:
            f = (fb.new(n),) if n != 1 else ()
            op_f.append(f)
            sl_f.append(f)
        else:
            op_f.append(_whole(fb, n, need))
            sl_f.append(_whole(fb, s, need))
    return fb, need, tuple(op_f), tuple(sl_f)


@register("dynamic_slice")
def dynamic_slice_rule(op) -> FactorRule:
    fb, need, op_f, out_f = _sliced(op.inputs[0].type.shape, op.outputs[0].type.shape)
    return FactorRule(tuple(fb.sizes), (op_f,) + ((),) * (len(op.inputs) - 1), (out_f,),
                      need_replication=frozenset(need), linear=(((0,), "sum"),), flops=numel(op.outputs[0].type.shape))


@register_localizer("dynamic_slice")
def _dynamic_slice_local(op, in_shapes, out_shapes):
    return {**op.params, "slice_sizes": tuple(out_shapes[0])}


@register("dynamic_update_slice")
def dynamic_update_slice_rule(op) -> FactorRule:
    fb, need, op_f, upd_f = _sliced(op.inputs[0].type.shape, op.inputs[1].type.shape)
    return FactorRule(tuple(fb.sizes), (op_f, upd_f) + ((),) * (len(op.inputs) - 2), (op_f,),
                      need_replication=frozenset(need), linear=(((0, 1), "sum"),),
                      flops=numel(op.inputs[1].type.shape))
