"""Sharding rules, one per primitive, registered in ``RULES`` by primitive name."""
from .base import LOCALIZERS, RULES, FactorRule, register, register_localizer  # noqa: F401
from . import (constants, contraction, control_flow, elementwise, indexing, random, reductions,  # noqa: F401
               shape_ops, structural, windows)  # (registration)
from .mirrored import FIXED  # noqa: F401  (shard_map: ops whose layouts the program fixes)

from ...ir.errors import sharding_error
from ...ir.graph import CONSTRAINT

from .elementwise import elementwise_rule


@register(CONSTRAINT)
def _constraint_rule(op):
    return elementwise_rule(op, (((0,), "sum"), ((0,), "max"), ((0,), "min")))


def rule_for(op) -> FactorRule:
    """The op's factor rule; an op with no rule is an error, never a silent replication."""
    fn = RULES.get(op.kind)
    if fn is None:
        raise sharding_error(f"primitive '{op.kind}' has no sharding rule, so shardprop cannot decide how to "
                             "split it", operator=op.kind, source=op.source,
                             shapes=tuple(v.type.shape for v in op.inputs),
                             fix=f"compute it outside the parallelized function, or register a rule with "
                                 f"@shardprop.passes.rules.register('{op.kind}')")
    return fn(op)
