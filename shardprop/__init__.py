"""shardprop: an auto-parallel graph compiler for JAX.

``import shardprop as sp``; mark a few operators with ``sp.shard``, compile with
``sp.parallelize``. Importing it joins no multi-process run: that happens at launch,
at the first ``parallelize`` (or ``Model``, ``DataLoader``, ``Checkpointer``), or with
``sp.init_distributed()`` (runtime/distributed.py). The repository's ``compiler/``,
``ir/``, ``passes/`` and ``runtime/`` folders are installed as ``shardprop.compiler``
and so on (see pyproject.toml), never as top-level names of their own.
"""
from .compiler import (CostModel, ParallelFunction, Pipeline, Plan, PlanCollective, PlanOp, ShardingError,  # noqa: F401
                       parallelize, report, shard, stage_boundary)
from . import ps  # noqa: F401  (parameter-server training; ray is imported only when a job starts)
from .runtime.checkpoint import Checkpointer  # noqa: F401
from .runtime.data import DataLoader, DistributedSampler  # noqa: F401
from .runtime.distributed import initialize as init_distributed  # noqa: F401
from .runtime.distributed import is_main_process, print0, to_numpy, use_cpu_devices  # noqa: F401
from .runtime.training import Callback, LossMonitor, Model, ModelCheckpoint, ProgressBar, StepInfo  # noqa: F401

__all__ = ["shard", "parallelize", "ParallelFunction", "Plan", "PlanOp", "PlanCollective", "ShardingError",
           "CostModel", "report", "Model", "Callback", "LossMonitor", "ModelCheckpoint", "ProgressBar", "StepInfo",
           "Checkpointer", "DataLoader", "DistributedSampler", "is_main_process", "print0", "to_numpy",
           "use_cpu_devices", "init_distributed", "Pipeline", "stage_boundary"]

# planning for a cluster that is not here (issue 28)
from .compiler.planning import PlanEstimate, plan_step  # noqa: E402,F401
from .passes.cluster import Cluster, GpuProfile  # noqa: E402,F401

__all__ += ["Cluster", "GpuProfile", "plan_step", "PlanEstimate"]
