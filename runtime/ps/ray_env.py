"""Ray is optional: a clear message when it is missing, and a local cluster whose
processes all go away when the job ends."""
from __future__ import annotations

import os
import sys

EXTRA_HINT = "pip install -e '.[ps]'"


class ParameterServerError(RuntimeError):
    """A parameter-server job cannot go on (a server died, or it cannot start)."""


def require_ray():
    """The ray module, or an ImportError that says which extra to install."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"asynchronous parameter-server training runs on Ray, which is not installed ({e}). "
                          f"Install the extra: {EXTRA_HINT}  (or: pip install 'shardprop[ps]')") from None
    return ray


def actor_options() -> dict:
    """Ray options of every server and worker actor: no CPU reservation (they share the
    machine's cores, however many there are) and the environment below, set per actor
    so it holds on a cluster someone else started too."""
    return {"num_cpus": 0, "max_restarts": 0, "runtime_env": {"env_vars": worker_env()}}


def worker_env() -> dict:
    """Environment for Ray's worker processes: the driver's import path (so a loss
    function from a script's folder unpickles there), JAX on the CPU unless the driver
    chose a platform (many processes must not each claim an accelerator), and no
    forced device count (one device per worker is enough)."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env = {"PYTHONPATH": os.pathsep.join(paths),
           "JAX_PLATFORMS": os.environ.get("SHARDPROP_PS_PLATFORM", "cpu"),
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


ENV_RAY_ADDRESS = "SHARDPROP_PS_RAY_ADDRESS"   # set by ``shardprop launch --server-num/--worker-num``


def connect(namespace: str | None = None):
    """Join the launcher's Ray cluster, or start a local one.
    Returns (ray, started_here): who started it stops it."""
    ray = require_ray()
    if ray.is_initialized():
        return ray, False
    address = os.environ.get(ENV_RAY_ADDRESS)
    kwargs = dict(include_dashboard=False, log_to_driver=True, configure_logging=False, namespace=namespace)
    if address:
        ray.init(address=address, **kwargs)
        return ray, False
    ray.init(num_cpus=os.cpu_count(), **kwargs)
    return ray, True
