"""Elementwise primitives: every operand dim is the same factor as the result dim.

Rank-0 operands (scalar literals, scalars broadcast by jax) take no factor.
``linear`` records which operands a pending partial sum/max may pass through:
``add(a, b)`` keeps ``a1+a2 + b1+b2`` a partial sum only if both are partial;
``mul(a, b)`` stays partial if exactly one side is; ``max`` passes a partial max.
"""
from __future__ import annotations

from .base import FactorBuilder, FactorRule, numel, register

_SUM_BOTH = (((0, 1), "sum"),)
_SUM_FIRST = (((0,), "sum"),)
_SUM_EITHER = (((0,), "sum"), ((1,), "sum"))
_MAX = (((0, 1), "max"), ((0,), "max"), ((1,), "max"))
_MIN = (((0, 1), "min"), ((0,), "min"), ((1,), "min"))

UNARY = ("exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
         "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "abs", "sign", "floor", "ceil",
         "round", "sqrt", "rsqrt", "cbrt", "integer_pow", "square", "erf", "erfc", "erf_inv", "lgamma",
         "digamma", "not", "is_finite", "population_count", "clz", "bessel_i0e", "bessel_i1e",
         "one_minus_square")
BINARY = ("pow", "rem", "atan2", "nextafter", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge",
          "shift_left", "shift_right_logical", "shift_right_arithmetic", "igamma", "igammac",
          "random_gamma_grad", "polygamma", "zeta")
NARY = ("clamp",)

_LINEAR = {
    "add": _SUM_BOTH, "sub": _SUM_BOTH, "add_any": _SUM_BOTH,
    "mul": _SUM_EITHER, "div": _SUM_FIRST,
    "neg": _SUM_FIRST, "copy": _SUM_FIRST, "copy_p": _SUM_FIRST, "stop_gradient": _SUM_FIRST,
    "reduce_precision": _SUM_FIRST, "real": _SUM_FIRST, "imag": _SUM_FIRST, "conj": _SUM_FIRST,
    "max": _MAX, "min": _MIN,
}


def elementwise_rule(op, linear=()) -> FactorRule:
    shape = op.outputs[0].type.shape
    fb = FactorBuilder()
    dims = fb.dims(shape)
    operands = []
    for v in op.inputs:
        if v.type.rank == 0:
            operands.append(())
        elif v.type.shape == shape:
            operands.append(dims)
        elif v.type.rank == len(shape) and all(a in (b, 1) for a, b in zip(v.type.shape, shape)):
            # jax broadcasts size-1 dims implicitly: those take no factor
            operands.append(tuple(f if a == b else () for f, a, b in zip(dims, v.type.shape, shape)))
        else:
            raise ValueError(f"operand shape {v.type.shape} does not match result shape {shape}")
    return FactorRule(tuple(fb.sizes), tuple(operands), (dims,) * len(op.outputs), linear=linear,
                      flops=numel(shape) * max(1, len(op.inputs)))


@register(*UNARY, *BINARY, *NARY)
def _plain(op):
    return elementwise_rule(op)


@register(*_LINEAR)
def _linear(op):
    return elementwise_rule(op, _LINEAR[op.kind])


@register("convert_element_type")
def _convert(op):
    src, dst = op.inputs[0].type.dtype, op.outputs[0].type.dtype
    floating = all(d.startswith(("float", "bfloat", "complex")) for d in (src, dst))
    return elementwise_rule(op, _SUM_FIRST if floating else ())


@register("select_n")
def _select_n(op):
    # select_n(pred, *cases): a partial passes through when every case carries it.
    cases = tuple(range(1, len(op.inputs)))
    return elementwise_rule(op, ((cases, "sum"), (cases, "max"), (cases, "min")))


# Every primitive this module gives the elementwise rule (what a compiler fuses into loops).
KINDS = frozenset((*UNARY, *BINARY, *NARY, *_LINEAR, "convert_element_type", "select_n"))
