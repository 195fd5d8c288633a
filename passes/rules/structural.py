"""Ops that keep some dims whole: concatenate, split, slice, pad, rev, the
cumulative ops, sort and top_k.

A dim such an op cuts, pads, reverses or scans along must be whole on every
device (a *need-replication* factor): propagation then gathers it first. Every
other dim passes through unchanged and may stay split.
"""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, numel, register, register_localizer


def _passthrough(op, whole_dims, linear=()) -> FactorRule:
    """One operand and one result of the same rank: dims in ``whole_dims`` stay whole
    (separate factors on each side), the rest are shared."""
    shape_in, shape_out = op.inputs[0].type.shape, op.outputs[0].type.shape
    fb = FactorBuilder()
    need = set()
    ins, outs = [], []
    for d, (a, b) in enumerate(zip(shape_in, shape_out)):
        if d in whole_dims:
            fa = (fb.new(a),) if a != 1 else ()
            fo = (fb.new(b),) if b != 1 else ()
            need.update(fa + fo)
            ins.append(fa)
            outs.append(fo)
        else:
            f = (fb.new(a),) if a != 1 else ()
            ins.append(f)
            outs.append(f)
    extra = ((),) * (len(op.inputs) - 1)
    return FactorRule(tuple(fb.sizes), (tuple(ins),) + extra, (tuple(outs),) * len(op.outputs),
                      need_replication=frozenset(need), linear=linear, flops=numel(shape_out))


@register("slice")
def slice_rule(op) -> FactorRule:
    p = op.params
    shape = op.inputs[0].type.shape
    strides = p.get("strides") or (1,) * len(shape)
    cut = {d for d, (s, e, st, n) in enumerate(zip(p["start_indices"], p["limit_indices"], strides, shape))
           if (s, e, st) != (0, n, 1)}
    return _passthrough(op, cut, linear=(((0,), "sum"),))


@register_localizer("slice")
def _slice_local(op, in_shapes, out_shapes):
    p = op.params
    shape = op.inputs[0].type.shape
    start, limit = list(p["start_indices"]), list(p["limit_indices"])
    for d, n in enumerate(shape):
        if (start[d], limit[d]) == (0, n):  # an uncut dim: the whole local block
            limit[d] = in_shapes[0][d]
    return {**p, "start_indices": tuple(start), "limit_indices": tuple(limit)}


@register("pad")
def pad_rule(op) -> FactorRule:
    padded = {d for d, cfg in enumerate(op.params["padding_config"]) if tuple(int(c) for c in cfg) != (0, 0, 0)}
    # pad(a1 + a2, v1 + v2) = pad(a1, v1) + pad(a2, v2): linear in operand and value together
    return _passthrough(op, padded, linear=(((0, 1), "sum"),))


@register("rev")
def rev_rule(op) -> FactorRule:
    return _passthrough(op, set(op.params["dimensions"]), linear=(((0,), "sum"),))


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative_rule(op) -> FactorRule:
    linear = (((0,), "sum"),) if op.kind == "cumsum" else ()
    return _passthrough(op, {op.params["axis"] % op.inputs[0].type.rank}, linear=linear)


@register("sort")
def sort_rule(op) -> FactorRule:
    """All operands are sorted together along ``dimension``, which stays whole."""
    shape = op.inputs[0].type.shape
    dim = op.params["dimension"] % len(shape)
    fb = FactorBuilder()
    dims = []
    need = set()
    for d, n in enumerate(shape):
        f = (fb.new(n),) if n != 1 else ()
        if d == dim:
            need.update(f)
        dims.append(f)
    dims = tuple(dims)
    return FactorRule(tuple(fb.sizes), (dims,) * len(op.inputs), (dims,) * len(op.outputs),
                      need_replication=frozenset(need), flops=numel(shape) * max(1, len(op.inputs)))


@register("top_k")
def top_k_rule(op) -> FactorRule:
    shape = op.inputs[0].type.shape
    axis = op.params.get("axis", len(shape) - 1) % len(shape)
    return _passthrough(op, {axis})


@register("concatenate")
def concatenate_rule(op) -> FactorRule:
    dim = op.params["dimension"]
    out = op.outputs[0].type.shape
    fb = FactorBuilder()
    shared = [(fb.new(n),) if n != 1 and d != dim else () for d, n in enumerate(out)]
    need = set()
    operands = []
    for v in op.inputs:
        f = (fb.new(v.type.shape[dim]),) if v.type.shape[dim] != 1 else ()
        need.update(f)
        operands.append(tuple(f if d == dim else shared[d] for d in range(len(out))))
    fo = (fb.new(out[dim]),) if out[dim] != 1 else ()
    need.update(fo)
    result = tuple(fo if d == dim else shared[d] for d in range(len(out)))
    return FactorRule(tuple(fb.sizes), tuple(operands), (result,), need_replication=frozenset(need),
                      linear=((tuple(range(len(op.inputs))), "sum"),), flops=numel(out))


@register("stack")
def stack_rule(op) -> FactorRule:
    """Operands of one shape stacked along a new dim: every other dim is shared, the new
    one (one entry per operand) stays whole."""
    axis = op.params["axis"]
    out = op.outputs[0].type.shape
    fb = FactorBuilder()
    shared = [(fb.new(n),) if n != 1 and d != axis else () for d, n in enumerate(out)]
    new = (fb.new(out[axis]),) if out[axis] != 1 else ()
    operand = tuple(f for d, f in enumerate(shared) if d != axis)
    result = tuple(new if d == axis else f for d, f in enumerate(shared))
    return FactorRule(tuple(fb.sizes), (operand,) * len(op.inputs), (result,), need_replication=frozenset(new),
                      linear=((tuple(range(len(op.inputs))), "sum"),), flops=numel(out))


@register("unstack")
def unstack_rule(op) -> FactorRule:
    """The inverse of stack (its transpose under grad): one result per entry of a dim
    that stays whole."""
    axis = op.params["axis"]
    shape = op.inputs[0].type.shape
    fb = FactorBuilder()
    shared = [(fb.new(n),) if n != 1 and d != axis else () for d, n in enumerate(shape)]
    gone = (fb.new(shape[axis]),) if shape[axis] != 1 else ()
    operand = tuple(gone if d == axis else f for d, f in enumerate(shared))
    result = tuple(f for d, f in enumerate(shared) if d != axis)
    return FactorRule(tuple(fb.sizes), (operand,), (result,) * len(op.outputs), need_replication=frozenset(gone),
                      linear=(((0,), "sum"),), flops=numel(shape))


@register("split")
def split_rule(op) -> FactorRule:
    axis = op.params["axis"] % op.inputs[0].type.rank
    shape = op.inputs[0].type.shape
    fb = FactorBuilder()
    shared = [(fb.new(n),) if n != 1 and d != axis else () for d, n in enumerate(shape)]
    need = set()

    def with_axis(size):
        f = (fb.new(size),) if size != 1 else ()
        need.update(f)
        return tuple(f if d == axis else shared[d] for d in range(len(shape)))
    operand = with_axis(shape[axis])
    results = tuple(with_axis(v.type.shape[axis]) for v in op.outputs)
    return FactorRule(tuple(fb.sizes), (operand,), results, need_replication=frozenset(need),
                      linear=(((0,), "sum"),), flops=numel(shape))
