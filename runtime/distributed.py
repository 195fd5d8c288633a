"""Joining a multi-process mesh: JAX's own distributed runtime (NCCL on GPUs,
gloo on CPUs), started from the launcher's environment, or from mpirun's or
SLURM's (which ``jax.distributed.initialize`` reads itself).

Importing shardprop joins nothing. A process joins its run, once, at the first of:
- launch: ``shardprop launch`` starts each rank through runtime/bootstrap.py, which
  joins before the script's first line runs;
- shardprop's entry points that look at devices: ``parallelize``, ``Model``,
  ``DataLoader`` / ``DistributedSampler``, ``Checkpointer``, ``is_main_process`` /
  ``print0`` / ``to_numpy``;
- ``sp.init_distributed()`` (this module's ``initialize``), for a script started by
  mpirun or SLURM that asks jax for devices (``jax.devices()``, an array op) before any
  of the above.
Without a launcher or cluster environment all of these do nothing, so a training
script needs no change between one process and many.
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
    if in_multiprocess_environment():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def in_multiprocess_environment() -> bool:
    """Whether a launcher, mpirun or SLURM started this process as one of several."""
    return ENV_COORDINATOR in os.environ or _cluster_environment()


def initialize() -> bool:
    """Join the multi-process run this process belongs to (``sp.init_distributed()``),
    before anything asks jax for devices. Idempotent; does nothing outside a launcher or
    cluster environment. Returns whether this process is part of a multi-process run."""
    global _initialized
    if _initialized:
        return True
    if not in_multiprocess_environment():
        return False
    if jax.distributed.is_initialized():   # the script called jax.distributed.initialize itself
        _initialized = True
        return True
    if _devices_in_use():
        raise RuntimeError(
            "this process is one of several (launcher, mpirun or SLURM environment), but jax's devices were "
            "asked for before it joined the run, so jax now sees this process's devices only: call "
            "sp.init_distributed() at the top of the script, before the first jax call that looks at devices "
            "(jax.devices(), jax.device_count(), creating an array)")
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
    else:   # mpirun or SLURM: jax reads their environment itself
        jax.distributed.initialize(initialization_timeout=timeout)
    _initialized = True
    return True


def _devices_in_use() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):   # another jax: jax.distributed.initialize says it itself
        return False


def is_main_process() -> bool:
    initialize()
    return jax.process_index() == 0


def to_numpy(x) -> np.ndarray:
    """A global array's full value on this process (gathered from every process if needed;
    every process calls it, as every process runs the step). ``x`` may also be a
    pipeline's packed state leaf (``gathered``: its buffer gathered through this)."""
    initialize()
    gathered = getattr(x, "gathered", None)
    if gathered is not None:
        return gathered(to_numpy)
    if not isinstance(x, jax.Array) or jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    owners = sorted({d.process_index for d in x.sharding.device_set})
    if len(owners) == jax.process_count():   # (every process holds a block of it)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    # on some processes only: where each process sees it (an MPMD pipeline returns a rank's
    # state on that rank's process, and a value every rank keeps on each process's own rank)
    seen = np.asarray(multihost_utils.process_allgather(np.int32(owners[0] if len(owners) == 1 else -1)))
    if len(owners) == 1 and all(int(p) == i for i, p in enumerate(seen)):   # (each its own copy)
        return np.asarray(x)
    if len(owners) == 1 and len(set(seen.tolist())) == 1:   # (one process holds it: sent from there)
        mine = jax.process_index() == owners[0]
        local = np.asarray(x) if mine else np.zeros(x.shape, x.dtype)
        return np.asarray(multihost_utils.broadcast_one_to_all(local, is_source=mine))
    raise ValueError(f"to_numpy: an array on the devices of processes {owners} of {jax.process_count()} "
                     f"(each process sees it on {seen.tolist()}): gather it on one process first, or read it "
                     "with np.asarray where it is addressable")


def print0(*args, **kwargs) -> None:
    """print on process 0 only."""
    if is_main_process():
        print(*args, **kwargs)
