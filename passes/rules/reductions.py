"""Reductions: the reduced dims are reduction factors.

A sharded reduced dim leaves a partial result (sum for reduce_sum, max/min for
reduce_max/min) that a later all_reduce completes. Reductions whose partial
results cannot be combined by one collective (prod, and/or, argmax) keep the
reduced dims whole.
"""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, numel, register

_COMBINE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


@register("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
          "reduce_xor", "argmax", "argmin")
def reduction_rule(op) -> FactorRule:
    shape = op.inputs[0].type.shape
    axes = set(op.params["axes"])
    fb = FactorBuilder()
    dims = fb.dims(shape)
    out = tuple(f for d, f in enumerate(dims) if d not in axes)
    reduced = frozenset(f for d, fs in enumerate(dims) if d in axes for f in fs)
    combine = _COMBINE.get(op.kind)
    linear = (((0,), combine),) if combine else ()
    return FactorRule(tuple(fb.sizes), (dims,), (out,), reduction=reduced, reduce_op=combine,
                      linear=linear, flops=numel(shape))
