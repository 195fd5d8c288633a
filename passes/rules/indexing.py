"""Indexing: gather (embedding lookups), scatter-add (their gradients),
dynamic_slice and dynamic_update_slice.

Indexed dims stay whole (a device cannot look up a row another device holds
without communication). Dims taken whole by every slice may stay split, and so
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


@register("gather")
def gather_rule(op) -> FactorRule:
    dn = op.params["dimension_numbers"]
    operand, indices = op.inputs[0].type.shape, op.inputs[1].type.shape
    out = op.outputs[0].type.shape
    sizes = op.params["slice_sizes"]
    fb = FactorBuilder()
    need: set = set()
    op_f: list = [()] * len(operand)
    idx_f: list = [()] * len(indices)
    out_f: list = [()] * len(out)
    # batch dims of the indices (all but the last, the index vector) are the output's non-offset dims
    batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
    for i, o in zip(range(len(indices) - 1), batch_out):
        f = (fb.new(indices[i]),) if indices[i] != 1 else ()
        idx_f[i] = out_f[o] = f
    idx_f[-1] = _whole(fb, indices[-1], need)
    for od, idd in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        op_f[od] = idx_f[idd]
    window = [d for d in range(len(operand)) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, o in zip(window, dn.offset_dims):
        if d not in dn.start_index_map and sizes[d] == operand[d]:
            f = (fb.new(operand[d]),) if operand[d] != 1 else ()
            op_f[d] = out_f[o] = f
        else:
            op_f[d] = _whole(fb, operand[d], need)
            out_f[o] = _whole(fb, out[o], need)
    for d in range(len(operand)):
        if d not in window and d not in dn.operand_batching_dims:
            op_f[d] = _whole(fb, operand[d], need)   # collapsed (indexed) dims
    return FactorRule(tuple(fb.sizes), (tuple(op_f), tuple(idx_f)), (tuple(out_f),),
                      need_replication=frozenset(need), flops=numel(out))


@register_localizer("gather")
def _gather_local(op, in_shapes, out_shapes):
    operand = op.inputs[0].type.shape
    sizes = tuple(local if s == full else s for s, full, local in
                  zip(op.params["slice_sizes"], operand, in_shapes[0]))
    return {**op.params, "slice_sizes": sizes}


@register("scatter-add", "scatter_add")
def scatter_add_rule(op) -> FactorRule:
    """operand + scatter(updates). The updates' scatter dims (rows added into the
    table) are reduction factors: split, each device adds its share and the result
    is a partial sum (the lowering zeroes the operand on all but one device of the
    group, so it is counted once)."""
    dn = op.params["dimension_numbers"]
    operand, indices, updates = (v.type.shape for v in op.inputs[:3])
    fb = FactorBuilder()
    need: set = set()
    op_f: list = [()] * len(operand)
    idx_f: list = [()] * len(indices)
    upd_f: list = [()] * len(updates)
    scatter_dims = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    reduction = set()
    for i, u in zip(range(len(indices) - 1), scatter_dims):
        f = (fb.new(indices[i]),) if indices[i] != 1 else ()
        idx_f[i] = upd_f[u] = f
        reduction.update(f)
    idx_f[-1] = _whole(fb, indices[-1], need)
    for od, idd in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        op_f[od] = idx_f[idd]
        reduction.difference_update(idx_f[idd])   # a batching dim is matched, not summed
    window = [d for d in range(len(operand)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    for d, u in zip(window, dn.update_window_dims):
        if d not in dn.scatter_dims_to_operand_dims and updates[u] == operand[d]:
            f = (fb.new(operand[d]),) if operand[d] != 1 else ()
            op_f[d] = upd_f[u] = f
        else:
            op_f[d] = _whole(fb, operand[d], need)
            upd_f[u] = _whole(fb, updates[u], need)
    for d in range(len(operand)):
        if d not in window and d not in dn.operand_batching_dims:
            op_f[d] = _whole(fb, operand[d], need)
    out = tuple(op_f)
    return FactorRule(tuple(fb.sizes), (out, tuple(idx_f), tuple(upd_f)), (out,),
                      reduction=frozenset(reduction), reduce_op="sum", need_replication=frozenset(need),
                      linear=(((0, 2), "sum"),), flops=numel(updates))


def _sliced(op, operand_shape, slice_shape, n_extra_tensors):
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
    fb, need, op_f, out_f = _sliced(op, op.inputs[0].type.shape, op.outputs[0].type.shape, 0)
    return FactorRule(tuple(fb.sizes), (op_f,) + ((),) * (len(op.inputs) - 1), (out_f,),
                      need_replication=frozenset(need), linear=(((0,), "sum"),), flops=numel(op.outputs[0].type.shape))


@register_localizer("dynamic_slice")
def _dynamic_slice_local(op, in_shapes, out_shapes):
    return {**op.params, "slice_sizes": tuple(out_shapes[0])}


@register("dynamic_update_slice")
def dynamic_update_slice_rule(op) -> FactorRule:
    fb, need, op_f, upd_f = _sliced(op, op.inputs[0].type.shape, op.inputs[1].type.shape, 0)
    return FactorRule(tuple(fb.sizes), (op_f, upd_f) + ((),) * (len(op.inputs) - 2), (op_f,),
                      need_replication=frozenset(need), linear=(((0, 1), "sum"),),
                      flops=numel(op.inputs[1].type.shape))
