"""dot_general: batch factors shared by both sides, free factors of each side,
and contracting factors that are reduced (a sharded one leaves a partial sum)."""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, register


@register("dot_general")
def dot_general_rule(op) -> FactorRule:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.inputs[0].type.shape, op.inputs[1].type.shape
    fb = FactorBuilder()
    lhs_f: list = [()] * len(lhs)
    rhs_f: list = [()] * len(rhs)
    out: list = []
    work = 2.0
    for l, r in zip(lb, rb):
        f = (fb.new(lhs[l]),) if lhs[l] != 1 else ()
        lhs_f[l] = rhs_f[r] = f
        out.append(f)
        work *= lhs[l]
    for d, s in enumerate(lhs):
        if d not in lb and d not in lc:
            f = (fb.new(s),) if s != 1 else ()
            lhs_f[d] = f
            out.append(f)
            work *= s
    for d, s in enumerate(rhs):
        if d not in rb and d not in rc:
            f = (fb.new(s),) if s != 1 else ()
            rhs_f[d] = f
            out.append(f)
            work *= s
    reduction = []
    for l, r in zip(lc, rc):
        if lhs[l] != 1:
            f = fb.new(lhs[l])
            lhs_f[l] = rhs_f[r] = (f,)
            reduction.append(f)
        work *= lhs[l]
    return FactorRule(tuple(fb.sizes), (tuple(lhs_f), tuple(rhs_f)), (tuple(out),),
                      reduction=frozenset(reduction), reduce_op="sum",
                      linear=(((0,), "sum"), ((1,), "sum")), flops=work)
