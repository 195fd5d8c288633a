"""Sharding rules, one per primitive, registered in ``RULES`` by primitive name."""
from .base import LOCALIZERS, RULES, FactorRule, register, register_localizer, rule_for  # noqa: F401
from . import (constants, contraction, control_flow, elementwise, indexing, random, reductions,  # noqa: F401
               shape_ops, structural, windows)  # (registration)
from .mirrored import FIXED  # noqa: F401  (shard_map: ops whose layouts the program fixes)

from ...ir.graph import CONSTRAINT

from .elementwise import elementwise_rule


@register(CONSTRAINT)
def _constraint_rule(op):
    return elementwise_rule(op, (((0,), "sum"), ((0,), "max"), ((0,), "min")))
