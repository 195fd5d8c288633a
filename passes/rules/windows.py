"""Windowed ops: convolutions and pooling.

Batch and feature dims may be split: a convolution over split input features is
a contraction and leaves a partial sum, like a matmul. A spatial dim may stay
split only where no window crosses a block edge (window 1, stride 1, no padding
or dilation); otherwise it is kept whole, since a halo exchange is not
implemented.
"""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, numel, register


def _trivial_window(window, stride=1, pad=(0, 0), lhs_dil=1, rhs_dil=1) -> bool:
    return window == 1 and stride == 1 and tuple(pad) == (0, 0) and lhs_dil == 1 and rhs_dil == 1


@register("conv_general_dilated")
def conv_rule(op) -> FactorRule:
    p = op.params
    dn = p["dimension_numbers"]
    lhs, rhs = op.inputs[0].type.shape, op.inputs[1].type.shape
    out = op.outputs[0].type.shape
    fb = FactorBuilder()
    need: set = set()
    lhs_f, rhs_f, out_f = [()] * len(lhs), [()] * len(rhs), [()] * len(out)

    def fresh(n, whole=False):
        if n == 1:
            return ()
        f = fb.new(n)
        if whole:
            need.add(f)
        return (f,)
    grouped = p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1
    n_l, c_l, *sp_l = dn.lhs_spec
    o_r, i_r, *sp_r = dn.rhs_spec
    n_o, c_o, *sp_o = dn.out_spec
    if p.get("batch_group_count", 1) == 1:
        lhs_f[n_l] = out_f[n_o] = fresh(lhs[n_l])
    else:
        lhs_f[n_l], out_f[n_o] = fresh(lhs[n_l], True), fresh(out[n_o], True)
    # output features: the kernel's out-feature dim is the result's feature dim
    if not grouped:
        rhs_f[o_r] = out_f[c_o] = fresh(rhs[o_r])
        feat = fresh(lhs[c_l])          # contracted input features
        lhs_f[c_l] = rhs_f[i_r] = feat
        reduction = set(feat)
    else:
        rhs_f[o_r], out_f[c_o] = fresh(rhs[o_r], True), fresh(out[c_o], True)
        lhs_f[c_l], rhs_f[i_r] = fresh(lhs[c_l], True), fresh(rhs[i_r], True)
        reduction = set()
    strides = p["window_strides"]
    pads = p["padding"]
    lhs_dil = p.get("lhs_dilation") or (1,) * len(sp_l)
    rhs_dil = p.get("rhs_dilation") or (1,) * len(sp_l)
    for k, (a, b, o) in enumerate(zip(sp_l, sp_r, sp_o)):
        window = rhs[b]
        if _trivial_window(window, strides[k], pads[k], lhs_dil[k], rhs_dil[k]) and lhs[a] == out[o]:
            lhs_f[a] = out_f[o] = fresh(lhs[a])
        else:
            lhs_f[a], out_f[o] = fresh(lhs[a], True), fresh(out[o], True)
        rhs_f[b] = fresh(rhs[b], True)
    work = 2.0 * numel(out) * numel(rhs) / max(1, out[c_o])
    return FactorRule(tuple(fb.sizes), (tuple(lhs_f), tuple(rhs_f)), (tuple(out_f),),
                      reduction=frozenset(reduction), reduce_op="sum", need_replication=frozenset(need),
                      linear=(((0,), "sum"), ((1,), "sum")), flops=work)


def _window_dims(op):
    p = op.params
    rank = op.inputs[-1].type.rank
    strides = p.get("window_strides") or (1,) * rank
    pads = p.get("padding") or ((0, 0),) * rank
    base = p.get("base_dilation") or (1,) * rank
    wdil = p.get("window_dilation") or (1,) * rank
    return [_trivial_window(w, s, pad, b, d) for w, s, pad, b, d in
            zip(p["window_dimensions"], strides, pads, base, wdil)]


_POOL_LINEAR = {"reduce_window_sum": (((0,), "sum"),), "reduce_window_max": (((0,), "max"),),
                "reduce_window_min": (((0,), "min"),)}


def _windowed(a_shape, b_shape, free):
    """Factors of two tensors a window op relates dim by dim: shared where the window
    is trivial and sizes agree, separate and kept whole elsewhere."""
    fb = FactorBuilder()
    need: set = set()
    fa_dims, fb_dims = [], []
    for d, (a, b) in enumerate(zip(a_shape, b_shape)):
        if free[d] and a == b:
            f = (fb.new(a),) if a != 1 else ()
            fa_dims.append(f)
            fb_dims.append(f)
        else:
            fa = (fb.new(a),) if a != 1 else ()
            fo = (fb.new(b),) if b != 1 else ()
            need.update(fa + fo)
            fa_dims.append(fa)
            fb_dims.append(fo)
    return fb, frozenset(need), tuple(fa_dims), tuple(fb_dims)


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def pooling_rule(op) -> FactorRule:
    shape_in = op.inputs[0].type.shape
    fb, need, ins, outs = _windowed(shape_in, op.outputs[0].type.shape, _window_dims(op))
    return FactorRule(tuple(fb.sizes), (ins,), (outs,), need_replication=need, linear=_POOL_LINEAR[op.kind],
                      flops=numel(shape_in))


@register("select_and_scatter_add")
def select_and_scatter_add_rule(op) -> FactorRule:
    """The max-pool gradient: source (pooled shape) scattered into operand's shape."""
    source, operand = op.inputs[0].type.shape, op.inputs[1].type.shape
    fb, need, src_f, op_f = _windowed(source, operand, _window_dims(op))
    return FactorRule(tuple(fb.sizes), (src_f, op_f), (op_f,), need_replication=need, linear=(((0,), "sum"),),
                      flops=numel(operand))
