"""Joining a multi-process mesh: JAX's own distributed runtime (NCCL on GPUs,
gloo on CPUs), started from the launcher's environment, or from mpirun's or
SLURM's (which ``jax.distributed.initialize`` reads itself).

A training script needs no change between one process and many: ``parallelize``
calls ``initialize()`` before it first looks at devices, and it does nothing
when no launcher or cluster environment is present.
"""
from __future__ import annotations

import os

import jax
import numpy as np

ENV_COORDINATOR = "SHARDPROP_COORDINATOR"
ENV_NUM_PROCESSES = "SHARDPROP_NUM_PROCESSES"
ENV_PROCESS_ID = "SHARDPROP_PROCESS_ID"
ENV_INIT_TIMEOUT = "SHARDPROP_INIT_TIMEOUT"

_initialized = False


def _cluster_environment() -> bool:
    """mpirun (Open MPI) or SLURM with more than one task: jax detects these itself."""
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


def use_cpu_devices(n: int) -> None:
    """For examples and tests: run on ``n`` forced CPU devices, unless a launcher (or
    cluster) already decided the devices of this process. Call before jax starts."""
    if ENV_COORDINATOR in os.environ or _cluster_environment():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def initialize() -> bool:
    """Start the distributed runtime if this process is one of several. Idempotent.
    Returns whether this process is part of a multi-process run."""
    global _initialized
    if _initialized:
        return True
    timeout = int(os.environ.get(ENV_INIT_TIMEOUT, "120"))
    if ENV_COORDINATOR in os.environ:
        address = os.environ[ENV_COORDINATOR]
        try:
            jax.distributed.initialize(coordinator_address=address,
                                       num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                                       process_id=int(os.environ[ENV_PROCESS_ID]),
                                       initialization_timeout=timeout)
        except Exception as e:   # jax's own message is a gRPC status; say what it means
            raise RuntimeError(
                f"process {os.environ[ENV_PROCESS_ID]} could not join the run coordinated at {address} within "
                f"{timeout} s: is process 0 running, and is that address reachable from here? ({e})") from None
    elif _cluster_environment():
        jax.distributed.initialize(initialization_timeout=timeout)
    else:
        return False
    _initialized = True
    return True


def is_main_process() -> bool:
    return jax.process_index() == 0


def to_numpy(x) -> np.ndarray:
    """A global array's full value on this process (gathered from every process if needed)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def print0(*args, **kwargs) -> None:
    """print on process 0 only."""
    if is_main_process():
        print(*args, **kwargs)
