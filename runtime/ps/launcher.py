"""``shardprop launch --server-num N --worker-num M script.py``, asynchronous mode:
a Ray cluster (runtime/ps/head.py), then N server and M worker processes of the
same script, each told its role by the environment (runtime/ps/roles.py).

Logs: ``log/serverlog.<i>``, ``log/workerlog.<i>`` (worker 0's also on the
console) and ``log/raylog`` (the cluster). A worker that fails is reported and the
others go on; a server that fails stops the run (the rows it held are gone) and
the launcher exits non-zero naming it. When every worker has ended, the servers
print their staleness reports and stop, then the cluster; Ctrl-C or SIGTERM stops
everything the same way. Every process is started in its own session and stopped
by process group (SIGTERM, then SIGKILL), so nothing outlives the run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ..processes import describe_status, show_tail, start_logged, stop_groups
from .ray_env import ENV_RAY_ADDRESS
from .roles import ENV_INDEX, ENV_MODE, ENV_ROLE, ENV_SERVERS, ENV_WORKERS

HEAD_START_S = 120.0
GRACE_S = 5.0          # servers print their reports on SIGTERM
HEAD_GRACE_S = 40.0    # ray.shutdown stops the cluster's processes one by one (slow on a busy machine)
POLL_S = 0.1
SERVER_DEATH_WINDOW_S = 3.0   # a worker failing because a server died is the server's failure
# Ray's token authentication (its default): the cluster's processes and the roles that
# join it read the same token (~/.ray/auth_token, written by the head)
AUTH = {"RAY_AUTH_MODE": "token"}


@dataclass
class Role:
    name: str            # "server" or "worker"
    index: int
    proc: subprocess.Popen
    log: str
    tee: threading.Thread = None

    @property
    def label(self) -> str:
        return f"{self.name} {self.index}"


def _start_head(log_dir: str):
    address_file = os.path.join(log_dir, ".ray_address")
    if os.path.exists(address_file):
        os.remove(address_file)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **AUTH)
    head, _ = start_logged([sys.executable, "-m", "shardprop.runtime.ps.head", address_file], env,
                           os.path.join(log_dir, "raylog"))
    deadline = time.monotonic() + HEAD_START_S
    while not os.path.exists(address_file):
        if head.poll() is not None or time.monotonic() > deadline:
            stop_groups([head], GRACE_S)
            return head, None
        time.sleep(POLL_S)
    with open(address_file) as f:
        return head, f.read().strip()


def run(num_servers: int, num_workers: int, log_dir: str, script: str, script_args: list) -> int:
    os.makedirs(log_dir, exist_ok=True)
    print(f"shardprop launch: {num_servers} server(s) and {num_workers} worker(s) on Ray (async); logs in "
          f"{log_dir}/serverlog.<i>, {log_dir}/workerlog.<i>, {log_dir}/raylog", flush=True)
    stopping = {"signal": None}
    old = {s: signal.signal(s, lambda signum, _f: stopping.update(signal=signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    head, address = _start_head(log_dir)
    roles: list[Role] = []
    try:
        if address is None:
            print(f"shardprop launch: the Ray cluster did not start; see {log_dir}/raylog", file=sys.stderr)
            show_tail(os.path.join(log_dir, "raylog"))
            return 1
        base = dict(os.environ, PYTHONUNBUFFERED="1", **AUTH)
        base.update({ENV_RAY_ADDRESS: address, ENV_SERVERS: str(num_servers), ENV_WORKERS: str(num_workers),
                     ENV_MODE: "async"})
        cmd = [sys.executable, "-u", script] + list(script_args)
        for name, count in (("server", num_servers), ("worker", num_workers)):
            for i in range(count):
                log = os.path.join(log_dir, f"{name}log.{i}")
                p, t = start_logged(cmd, dict(base, **{ENV_ROLE: name, ENV_INDEX: str(i)}), log,
                                    console=(name == "worker" and i == 0))
                roles.append(Role(name, i, p, log, t))
        return _watch(roles, stopping)
    finally:
        stop_groups([r.proc for r in roles if r.name == "worker"], GRACE_S)
        stop_groups([r.proc for r in roles if r.name == "server"], GRACE_S)   # after the workers: they print reports
        stop_groups([head], HEAD_GRACE_S)
        for r in roles:
            if r.tee is not None:
                r.tee.join(timeout=2)
        for s, h in old.items():
            signal.signal(s, h)


def _watch(roles, stopping) -> int:
    servers = [r for r in roles if r.name == "server"]
    workers = [r for r in roles if r.name == "worker"]
    reported = set()
    while True:
        if stopping["signal"] is not None:
            name = signal.Signals(stopping["signal"]).name
            print(f"shardprop launch: received {name}; stopping every server and worker", file=sys.stderr,
                  flush=True)
            return 128 + stopping["signal"]
        for r in servers:
            code = r.proc.poll()
            if code is not None:
                print(f"shardprop launch: {r.label} ended ({describe_status(code)}) while workers were training: "
                      f"the parameters it held are gone, so the run is stopped. See {r.log}",
                      file=sys.stderr, flush=True)
                show_tail(r.log)
                return code if code > 0 else (128 - code if code < 0 else 1)
        for r in workers:
            code = r.proc.poll()
            if code not in (None, 0) and r.index not in reported:
                if _a_server_dies_soon(servers):
                    break    # the next pass reports the server
                reported.add(r.index)
                left = sum(1 for w in workers if w.proc.poll() is None)
                print(f"shardprop launch: {r.label} failed ({describe_status(code)}); the {len(servers)} server(s) "
                      f"and {left} other worker(s) carry on. See {r.log}", file=sys.stderr, flush=True)
                show_tail(r.log, lines=5)
        if all(w.proc.poll() is not None for w in workers):
            ok = [w for w in workers if w.proc.returncode == 0]
            if not ok:
                print("shardprop launch: every worker failed", file=sys.stderr, flush=True)
                return 1
            print(f"shardprop launch: done; {len(ok)} of {len(workers)} worker(s) finished"
                  + (f", failed: {', '.join(str(i) for i in sorted(reported))}" if reported else ""), flush=True)
            return 0
        time.sleep(POLL_S)


def _a_server_dies_soon(servers) -> bool:
    deadline = time.monotonic() + SERVER_DEATH_WINDOW_S
    while time.monotonic() < deadline:
        if any(s.proc.poll() is not None for s in servers):
            return True
        time.sleep(POLL_S)
    return False
