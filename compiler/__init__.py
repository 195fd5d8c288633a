"""shardprop's public API: ``shard`` marks operators, ``parallelize`` compiles.

Importing it has no side effects beyond registering the ``shardprop_mark`` primitive
with jax: a multi-process run is joined at launch, at the first ``parallelize``, or by
``sp.init_distributed()`` (runtime/distributed.py)."""
from ..ir.errors import ShardingError
from ..passes.cost import CostModel

from .annotate import shard
from .api import ParallelFunction, parallelize, report
from .plan import Plan, PlanCollective, PlanOp
from .stages import Pipeline, stage_boundary

__all__ = ["shard", "parallelize", "ParallelFunction", "Plan", "PlanOp", "PlanCollective", "ShardingError",
           "CostModel", "report", "Pipeline", "stage_boundary"]
