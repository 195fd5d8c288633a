"""Ops that make a value from nothing but their params (``empty2``, which jax's
autodiff of ``cond`` emits for unused residuals): every dim is its own factor."""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, numel, register


@register("empty2", "empty")
def fresh_value_rule(op) -> FactorRule:
    fb = FactorBuilder()
    out = tuple(fb.dims(v.type.shape) for v in op.outputs)
    return FactorRule(tuple(fb.sizes), (), out, flops=sum(numel(v.type.shape) for v in op.outputs))
