"""shardprop's public API: ``shard`` marks operators, ``parallelize`` compiles."""
from ..runtime.distributed import initialize as _initialize_distributed

# Under the launcher (or mpirun / SLURM), join the multi-process runtime now: it must
# start before anything asks jax for devices. Without such an environment: nothing.
_initialize_distributed()

from ..ir.errors import ShardingError  # noqa: E402
from ..passes.cost import CostModel  # noqa: E402

from .annotate import shard  # noqa: E402
from .api import ParallelFunction, parallelize  # noqa: E402
from .plan import Plan, PlanCollective, PlanOp  # noqa: E402

__all__ = ["shard", "parallelize", "ParallelFunction", "Plan", "PlanOp", "PlanCollective", "ShardingError",
           "CostModel"]
