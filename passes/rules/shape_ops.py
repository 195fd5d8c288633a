"""Ops that move data between dims without arithmetic: broadcast_in_dim,
reshape, transpose, squeeze, iota."""
from __future__ import annotations

import math

from .base import FactorBuilder, FactorRule, numel, register, register_localizer


@register("transpose")
def transpose_rule(op) -> FactorRule:
    perm = op.params["permutation"]
    fb = FactorBuilder()
    dims = fb.dims(op.inputs[0].type.shape)
    return FactorRule(tuple(fb.sizes), (dims,), (tuple(dims[p] for p in perm),),
                      linear=(((0,), "sum"),), flops=numel(op.inputs[0].type.shape))


@register("squeeze")
def squeeze_rule(op) -> FactorRule:
    gone = {d % op.inputs[0].type.rank for d in op.params["dimensions"]}
    fb = FactorBuilder()
    dims = fb.dims(op.inputs[0].type.shape)
    out = tuple(f for d, f in enumerate(dims) if d not in gone)
    return FactorRule(tuple(fb.sizes), (dims,), (out,), linear=(((0,), "sum"),), flops=0)


@register("broadcast_in_dim")
def broadcast_rule(op) -> FactorRule:
    shape = op.params["shape"]
    bdims = op.params["broadcast_dimensions"]
    fb = FactorBuilder()
    out = fb.dims(shape)
    src = op.inputs[0].type.shape
    operand = tuple(out[r] if src[i] == shape[r] else () for i, r in enumerate(bdims))
    # Extra operands (dynamic shapes) are not supported; jax only emits them for polymorphism.
    return FactorRule(tuple(fb.sizes), (operand,) + ((),) * (len(op.inputs) - 1), (out,),
                      linear=(((0,), "sum"),), flops=numel(shape))


@register_localizer("broadcast_in_dim")
def _broadcast_local(op, in_shapes, out_shapes):
    return {**op.params, "shape": tuple(out_shapes[0])}


def _prefixes(dims):
    out, p = [], 1
    for s in dims:
        p *= s
        out.append(p)
    return out


def _factor_block(a, b, fb, need):
    """Factors of one block of dims with equal element counts on both sides."""
    pa, pb = _prefixes(a), _prefixes(b)
    bounds = sorted(set(pa) | set(pb))
    # Where the bounds of both sides refine one another (a chain), every factor is
    # shared. Otherwise the block's longest leading run that does keeps its factors
    # (blocks stay contiguous while a split takes whole sub-factors from the major end);
    # past its end E every dim part is whole.
    chain = all(bounds[k] % bounds[k - 1] == 0 for k in range(1, len(bounds)))
    end = bounds if chain else _chain_end(bounds, pa, pb)
    ids = [fb.new(end[0])] + [fb.new(end[k] // end[k - 1]) for k in range(1, len(end))] if end else []

    def split(dims, prefix):
        out, lo = [], 1
        e = end[-1] if end else 1
        for s, hi in zip(dims, prefix):
            if s == 1:
                out.append(())
            elif hi <= e:
                out.append(tuple(f for f, bd in zip(ids, end) if lo < bd <= hi))
            else:
                keep = tuple(f for f, bd in zip(ids, end) if lo < bd <= e)
                rest = fb.new(hi // max(lo, e))
                need.add(rest)
                out.append(keep + (rest,))
            lo = hi
        return out
    return split(a, pa), split(b, pb)


def _chain_end(bounds, pa, pb) -> list:
    """The leading run of a block without a common refinement: for the largest E such
    that both sides' prefix bounds below E, and E, divide one another in turn, and E
    divides the next prefix of each side (each side's dim straddling E then splits into
    a major part made of the run's factors and a whole minor rest), the bounds up to E."""
    total = bounds[-1]
    divisors = sorted({d for k in range(1, math.isqrt(total) + 1) if total % k == 0 for d in (k, total // k)},
                      reverse=True)
    for e in divisors:
        if e in (1, total):
            continue
        run = sorted({p for p in pa + pb if p < e} | {e})
        if any(run[k] % run[k - 1] for k in range(1, len(run))):
            continue
        if all(next(p for p in prefix if p >= e) % e == 0 for prefix in (pa, pb)):
            return run
    return []


def reshape_factors(a, b, fb):
    """Per-dim factors of a reshape from shape ``a`` to shape ``b``."""
    a_f, b_f, need = [], [], set()
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            a_f.append(()); i += 1; continue
        if j < len(b) and b[j] == 1:
            b_f.append(()); j += 1; continue
        i0, j0 = i, j
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]; i += 1
            else:
                pb *= b[j]; j += 1
        fa, fbb = _factor_block(list(a[i0:i]), list(b[j0:j]), fb, need)
        a_f += fa
        b_f += fbb
    return tuple(a_f), tuple(b_f), need


@register("reshape")
def reshape_rule(op) -> FactorRule:
    if op.params.get("dimensions") is not None:
        raise NotImplementedError("reshape with a dimensions permutation")
    fb = FactorBuilder()
    a_f, b_f, need = reshape_factors(op.inputs[0].type.shape, op.outputs[0].type.shape, fb)
    return FactorRule(tuple(fb.sizes), (a_f,) + ((),) * (len(op.inputs) - 1), (b_f,),
                      need_replication=frozenset(need), linear=(((0,), "sum"),), flops=0)


@register_localizer("reshape")
def _reshape_local(op, in_shapes, out_shapes):
    return {**op.params, "new_sizes": tuple(out_shapes[0])}


@register("iota")
def iota_rule(op) -> FactorRule:
    fb = FactorBuilder()
    out = fb.dims(op.params["shape"])
    return FactorRule(tuple(fb.sizes), (), (out,), flops=numel(op.params["shape"]))


@register_localizer("iota")
def _iota_local(op, in_shapes, out_shapes):
    # The offset of a sharded iota dimension is added by the lowering (runtime.lower).
    return {**op.params, "shape": tuple(out_shapes[0])}
