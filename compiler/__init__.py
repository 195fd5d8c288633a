"""shardprop's public API: ``shard`` marks operators, ``parallelize`` compiles."""
from ir.errors import ShardingError
from passes.cost import CostModel

from .annotate import shard
from .api import ParallelFunction, parallelize
from .plan import Plan, PlanCollective, PlanOp

__all__ = ["shard", "parallelize", "ParallelFunction", "Plan", "PlanOp", "PlanCollective", "ShardingError",
           "CostModel"]
