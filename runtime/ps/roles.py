"""One script, every role. ``shardprop launch --server-num N --worker-num M`` starts
N server processes and M worker processes of the same script; the environment
tells each its role and index, and ``run`` runs that role's loop:

- a server process creates its server actor (rows ``i`` of every table and its
  share of the dense leaves, from the script's own initial parameters), serves
  until the launcher stops it, and then prints its staleness report;
- a worker process finds the servers by name and trains until they have seen the
  sample budget;
- outside the launcher, ``run`` starts a local job with ``num_servers`` /
  ``num_workers`` actors, so the same script runs on its own too.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

ENV_ROLE = "SHARDPROP_PS_ROLE"        # "server" or "worker"
ENV_INDEX = "SHARDPROP_PS_INDEX"
ENV_SERVERS = "SHARDPROP_PS_SERVERS"
ENV_WORKERS = "SHARDPROP_PS_WORKERS"
ENV_MODE = "SHARDPROP_PS_MODE"
NAMESPACE = "shardprop_ps"
FIND_SERVERS_S = 120.0
LOG_EVERY = 10          # a worker prints its progress every this many steps


def role() -> str | None:
    """'server', 'worker', or None outside ``shardprop launch --server-num/--worker-num``."""
    return os.environ.get(ENV_ROLE)


def is_server() -> bool:
    return role() == "server"


def is_worker() -> bool:
    return role() == "worker"


def role_index() -> int:
    return int(os.environ.get(ENV_INDEX, "0"))


def _say(msg: str) -> None:
    print(f"{role() or 'driver'} {role_index()}: {msg}", flush=True)


@dataclass
class RoleResult:
    """What ``run`` returns: this process's role and index, its report (a worker's
    samples, samples/s, losses, bytes; a server's version and staleness; a local
    job's TrainResult), and ``params`` (the trained parameters, or None in a server)."""
    role: str
    index: int
    report: object
    params: Optional[Callable] = None


def run(loss_fn, params: dict, tables: dict, batches, optimizer, *, samples: int, num_servers: int = 1,
        num_workers: int = 2, max_staleness=16, k_steps=None):
    """Train ``loss_fn`` asynchronously until the servers have seen ``samples`` samples;
    with ``k_steps``, GEO (each worker trains k steps on its own copy, then pushes the delta).
    Returns a RoleResult."""
    mode = "async" if k_steps is None else "geo"
    if role() is None:
        from .job import Job
        with Job(loss_fn, params, tables, batches, optimizer, num_servers=num_servers, num_workers=num_workers,
                 mode=mode, max_staleness=max_staleness, k_steps=k_steps) as job:
            result = job.train(samples)
            trained = job.params()
            return RoleResult("driver", 0, result, lambda: trained)
    if os.environ.get(ENV_MODE, "async") != "async":
        raise RuntimeError(f"sp.ps.run trains asynchronously (or GEO) on Ray; this process was launched for "
                           f"{os.environ[ENV_MODE]!r} (use sp.ps.sync / sp.ps.geo there)")
    from .job import Job
    num_servers, num_workers = int(os.environ[ENV_SERVERS]), int(os.environ[ENV_WORKERS])
    plan = Job(loss_fn, params, tables, batches, optimizer, num_servers=num_servers, num_workers=num_workers,
               mode=mode, max_staleness=max_staleness, k_steps=k_steps)   # the layout; no actors started here
    from .ray_env import connect
    ray, _ = connect(namespace=NAMESPACE)
    if is_server():
        return _serve(ray, plan, role_index())
    return _work(ray, plan, role_index(), samples)


def _serve(ray, plan, index: int) -> dict:
    from .ray_env import ParameterServerError, actor_options
    from .server import ParameterServer
    server = ray.remote(**actor_options())(ParameterServer).options(name=f"server{index}").remote(
        index, *plan.server_share(index), plan.optimizer, plan.mode, plan.max_staleness)
    pid = ray.get(server.pid.remote())
    rows = ", ".join(f"{t} rows {b[index]}-{b[index + 1] - 1}" for t, b in plan.layout.table_bounds.items())
    _say(f"serving {rows} and {len(plan.layout.dense_on(index))} dense leaves (actor pid {pid})")
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    while not stop["now"]:
        try:
            ray.get(server.ping.remote(), timeout=30)
        except Exception as e:
            raise ParameterServerError(f"parameter server {index} (actor pid {pid}; {rows}) died "
                                       f"({type(e).__name__}): the parameters it held are gone") from None
        time.sleep(0.5)
    stats = ray.get(server.stats.remote())
    s = stats["staleness"]
    _say(f"stopped after {stats['version']} updates from {stats['samples']} samples; staleness max {s['max']}, "
         f"mean {s['mean']:.2f}, refused {s['refused']} (bound {s['bound']})")
    return RoleResult("server", index, stats)


def _work(ray, plan, index: int, samples: int) -> dict:
    from .geo_worker import GeoWorker
    from .worker import Worker
    servers = [_find(ray, f"server{s}") for s in range(plan.num_servers)]
    args = (index, plan.num_workers, servers, plan.layout, plan.loss_fn, plan.dense_template, plan.batches)
    worker = (GeoWorker(*args, optimizer=plan.optimizer, k_steps=plan.k_steps) if plan.mode == "geo"
              else Worker(*args))
    report = worker.run(samples, log_every=LOG_EVERY)
    _say(f"done: {report['samples']} samples in {report['steps']} steps, {report['samples_per_s']:.0f} samples/s, "
         f"last loss {report['losses'][-1]:.4f}, {report['refused']} stale pushes refused")
    return RoleResult("worker", index, report, worker.params)


def _find(ray, name: str):
    deadline = time.monotonic() + FIND_SERVERS_S
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                print(f"no {name} after {FIND_SERVERS_S:.0f} s: did the server processes start?", file=sys.stderr)
                raise
            time.sleep(0.2)
