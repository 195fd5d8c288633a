"""``shardprop launch``: start one process per GPU (or CPU processes with K forced
devices each) that together form one JAX mesh, like ``fleetrun --gpus 0,1`` /
``--ips``, ``torchrun --nproc_per_node`` or ``mpirun -n``.

    shardprop launch --nproc 2 --devices-per-proc 4 train.py --epochs 3
    shardprop launch --gpus 0,1,2,3 train.py
    shardprop launch --ips 10.0.0.1,10.0.0.2 --gpus 0,1 train.py   # the same command on both hosts
    shardprop launch --server-num 1 --worker-num 2 train.py        # parameter servers (sp.ps)

With ``--server-num/--worker-num`` the same script runs in every role: asynchronous
(the default ``--ps-mode async``) starts a Ray cluster, N server and M worker
processes (runtime/ps/launcher.py; logs ``log/serverlog.<i>``, ``log/workerlog.<i>``);
``--ps-mode sync`` starts M worker processes on jax.distributed, as ``--nproc M``
does, the tables split by rows over their devices. ``sp.ps.is_server()`` /
``sp.ps.is_worker()`` tell the script its role.

Each rank joins the run (jax.distributed) before its script's first line runs
(runtime/bootstrap.py), so the script may look at jax's devices right away.
Every rank's output goes to ``log/workerlog.<rank>``; rank 0's is also streamed
to the console. When a rank fails or is killed, the others are stopped (SIGTERM,
then SIGKILL: after ``jax.distributed.initialize`` a process ignores SIGTERM, and
it would otherwise wait ~100 s for its dead peer's heartbeat), and the launcher
exits non-zero naming the rank, its exit status and its log. Ctrl-C or SIGTERM
to the launcher stops every rank the same way.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .bootstrap import ENV_FINISHED_MARK, ENV_STACKS_AFTER
from .distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from .processes import POLL_S, describe_status, show_tail, start_logged, stop_groups


EXIT_GRACE_S = 30.0


class LaunchError(Exception):
    """Bad arguments or environment, found before anything starts."""


@dataclass
class Config:
    nproc: int                   # processes on this host
    nnodes: int
    node_rank: int
    devices_per_proc: Optional[int]
    gpus: Optional[list[str]]
    coordinator: str
    log_dir: str
    script: str
    script_args: list[str]
    role_env: dict = field(default_factory=dict)   # sync parameter-server runs: every rank is a worker
    stacks_after: Optional[float] = None
    exit_grace: float = EXIT_GRACE_S

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    def rank(self, local: int) -> int:
        """The global rank of this host's ``local``-th process."""
        return self.node_rank * self.nproc + local

    def finished_mark(self, rank: int) -> str:
        """The file a rank writes once its script and exit handlers are done (runtime/bootstrap.py)."""
        return os.path.join(self.log_dir, f".finished.{rank}")


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_addresses() -> set[str]:
    names = {"127.0.0.1", "localhost", socket.gethostname()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(prog="shardprop launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--nproc", type=int, help="processes on this host (CPU or one GPU each)")
    group.add_argument("--gpus", help="comma-separated GPU ids, one process each, e.g. 0,1,2,3")
    ap.add_argument("--devices-per-proc", type=int, default=None,
                    help="forced CPU devices per process (CPU runs; default 1)")
    ap.add_argument("--ips", default=None, help="comma-separated hosts; the first coordinates")
    ap.add_argument("--node-rank", type=int, default=None, help="this host's index in --ips (default: found)")
    ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    ap.add_argument("--log-dir", default="log")
    ap.add_argument("--exit-grace", type=float, default=EXIT_GRACE_S, metavar="SECONDS",
                    help="a rank whose script and exit handlers have finished is given this long to exit, then "
                         f"stopped (its interpreter's teardown hung; default {EXIT_GRACE_S:g})")
    ap.add_argument("--stacks-after", type=float, default=None, metavar="SECONDS",
                    help="a rank still running after SECONDS writes every thread's Python stack into its log, "
                         "and again every SECONDS after (to see where a run that hangs waits)")
    ap.add_argument("--server-num", type=int, default=None, help="parameter servers (with --worker-num)")
    ap.add_argument("--worker-num", type=int, default=None, help="parameter-server workers")
    ap.add_argument("--ps-mode", choices=("async", "sync"), default="async",
                    help="async: servers and workers on Ray; sync: workers on jax.distributed (default async)")
    ap.add_argument("script")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.server_num is not None or a.worker_num is not None:
        return _parse_ps(a)

    gpus = [g for g in a.gpus.split(",") if g] if a.gpus else None
    nproc = len(gpus) if gpus else (a.nproc if a.nproc is not None else 1)
    if nproc < 1:
        raise LaunchError(f"--nproc {nproc}: need at least one process")
    if a.devices_per_proc is not None and a.devices_per_proc < 1:
        raise LaunchError(f"--devices-per-proc {a.devices_per_proc}: need at least one device per process")
    if gpus and a.devices_per_proc not in (None, 1):
        raise LaunchError("--devices-per-proc forces CPU devices; with --gpus each process has one GPU")
    if not os.path.isfile(a.script):
        raise LaunchError(f"script {a.script!r} not found")
    hosts = [h for h in a.ips.split(",") if h] if a.ips else ["127.0.0.1"]
    node_rank = a.node_rank
    if node_rank is None:
        mine = _local_addresses()
        matches = [i for i, h in enumerate(hosts) if h in mine]
        if len(hosts) == 1:
            node_rank = 0
        elif len(matches) != 1:
            raise LaunchError(f"cannot tell which of --ips {a.ips} is this host ({socket.gethostname()}); "
                              "pass --node-rank")
        else:
            node_rank = matches[0]
    if not 0 <= node_rank < len(hosts):
        raise LaunchError(f"--node-rank {node_rank} is not an index into --ips {a.ips}")
    host = hosts[0]
    port = a.port
    if port is None:
        if len(hosts) > 1:
            raise LaunchError("with --ips, give every host the same --port")
        port = _free_port()
    elif node_rank == 0 and not _port_is_free(host, port):
        raise LaunchError(f"coordinator port {port} on {host} is already in use; pick another --port "
                          "(or leave it out to get a free one)")
    if a.stacks_after is not None and a.stacks_after <= 0:
        raise LaunchError(f"--stacks-after {a.stacks_after}: give a number of seconds above 0")
    if a.exit_grace < 0:
        raise LaunchError(f"--exit-grace {a.exit_grace}: give a number of seconds, 0 or more")
    return Config(nproc, len(hosts), node_rank, a.devices_per_proc, gpus, f"{host}:{port}", a.log_dir,
                  a.script, a.script_args, stacks_after=a.stacks_after, exit_grace=a.exit_grace)


@dataclass
class PSConfig:
    """``--server-num N --worker-num M`` with ``--ps-mode async``: roles on Ray."""
    num_servers: int
    num_workers: int
    log_dir: str
    script: str
    script_args: list[str]


def _parse_ps(a):
    if a.worker_num is None or a.worker_num < 1:
        raise LaunchError(f"--worker-num {a.worker_num}: a parameter-server run needs at least one worker")
    if not os.path.isfile(a.script):
        raise LaunchError(f"script {a.script!r} not found")
    if a.nproc is not None or a.gpus or a.ips:
        raise LaunchError("--server-num/--worker-num decide the processes; leave out --nproc, --gpus and --ips")
    if a.ps_mode == "sync":
        # the SPMD form: the workers' devices hold the tables' row blocks; no server processes
        return Config(a.worker_num, 1, 0, a.devices_per_proc, None, f"127.0.0.1:{a.port or _free_port()}", a.log_dir,
                      a.script, a.script_args, role_env={"SHARDPROP_PS_ROLE": "worker", "SHARDPROP_PS_MODE": "sync",
                                                         "SHARDPROP_PS_SERVERS": "0",
                                                         "SHARDPROP_PS_WORKERS": str(a.worker_num)})
    if a.server_num is None or a.server_num < 1:
        given = "missing" if a.server_num is None else f"{a.server_num}"
        raise LaunchError(f"--server-num {given}: an async parameter-server run needs at least one server "
                          f"(--ps-mode sync needs none)")
    return PSConfig(a.server_num, a.worker_num, a.log_dir, a.script, a.script_args)


def worker_env(cfg: Config, local_rank: int) -> dict:
    env = dict(os.environ)
    rank = cfg.rank(local_rank)
    env[ENV_FINISHED_MARK] = cfg.finished_mark(rank)
    env[ENV_COORDINATOR] = cfg.coordinator
    env[ENV_NUM_PROCESSES] = str(cfg.world)
    env[ENV_PROCESS_ID] = str(rank)
    if cfg.role_env:
        env.update(cfg.role_env, SHARDPROP_PS_INDEX=str(rank))
    if cfg.gpus:
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpus[local_rank]
    else:
        k = cfg.devices_per_proc or 1
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={k}"])
    env["PYTHONUNBUFFERED"] = "1"
    if cfg.stacks_after is not None:
        env[ENV_STACKS_AFTER] = str(cfg.stacks_after)
    return env


class Workers:
    """The ranks on this host: started in their own sessions, stopped together."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self._threads: list[threading.Thread] = []
        self.cut_short: set[int] = set()   # local ranks stopped in their teardown, after finishing

    def start(self) -> None:
        os.makedirs(self.cfg.log_dir, exist_ok=True)
        for local in range(self.cfg.nproc):
            rank = self.cfg.rank(local)
            path = os.path.join(self.cfg.log_dir, f"workerlog.{rank}")
            self.logs.append(path)
            self._remove_mark(local)   # (a previous run's)
            # each rank joins the run before the script's first line (runtime/bootstrap.py)
            cmd = [sys.executable, "-u", "-m", "shardprop.runtime.bootstrap", self.cfg.script] + self.cfg.script_args
            p, tee = start_logged(cmd, worker_env(self.cfg, local), path, console=(rank == 0))
            self.procs.append(p)
            if tee is not None:
                self._threads.append(tee)

    def first_failure(self) -> Optional[tuple[int, int]]:
        for local, p in enumerate(self.procs):
            code = p.poll()
            if code not in (None, 0) and local not in self.cut_short:
                return self.cfg.rank(local), code
        return None

    def stop_hung_teardowns(self) -> list[int]:
        """Stop the ranks that finished (script, exit handlers: every rank passed jax's
        shutdown barrier) more than ``exit_grace`` seconds ago but have not exited.
        Returns their ranks."""
        stopped = []
        for local, p in enumerate(self.procs):
            rank = self.cfg.rank(local)
            if local in self.cut_short or p.poll() is not None:
                continue
            try:
                finished = os.path.getmtime(self.cfg.finished_mark(rank))
            except OSError:
                continue
            if time.time() - finished > self.cfg.exit_grace:
                self.cut_short.add(local)
                stop_groups([p], grace=0)
                stopped.append(rank)
        return stopped

    def all_done(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def stop(self) -> None:
        stop_groups(self.procs)
        for t in self._threads:
            t.join(timeout=2)
        for local in range(len(self.procs)):
            self._remove_mark(local)

    def _remove_mark(self, local: int) -> None:
        try:
            os.remove(self.cfg.finished_mark(self.cfg.rank(local)))
        except OSError:
            pass


def run(cfg: Config) -> int:
    devices = f"GPU {','.join(cfg.gpus)}" if cfg.gpus else f"{cfg.devices_per_proc or 1} CPU device(s) each"
    print(f"shardprop launch: {cfg.world} process(es) ({cfg.nproc} on this host, node {cfg.node_rank} of "
          f"{cfg.nnodes}), {devices}; coordinator {cfg.coordinator}; logs in {cfg.log_dir}/workerlog.<rank>",
          flush=True)
    workers = Workers(cfg)
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        workers.start()
        while True:
            if stopping["signal"] is not None:
                workers.stop()
                name = signal.Signals(stopping["signal"]).name
                print(f"shardprop launch: received {name}; stopped all ranks", file=sys.stderr, flush=True)
                return 128 + stopping["signal"]
            failure = workers.first_failure()
            if failure is not None:
                rank, code = failure
                workers.stop()
                log = os.path.join(cfg.log_dir, f"workerlog.{rank}")
                print(f"shardprop launch: rank {rank} failed ({describe_status(code)}); stopped the other ranks. "
                      f"See {log}", file=sys.stderr, flush=True)
                show_tail(log)
                return code if code > 0 else 128 - code
            for rank in workers.stop_hung_teardowns():
                print(f"shardprop launch: rank {rank} finished (its script and exit handlers ran) but did not exit "
                      f"within {cfg.exit_grace:g} s; stopped it", file=sys.stderr, flush=True)
            if workers.all_done():
                workers.stop()   # joins the console thread
                return 0
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(f"shardprop launch: error: {e}", file=sys.stderr)
        return 2
    if isinstance(cfg, PSConfig):
        try:
            from .ps.ray_env import require_ray
            require_ray()
        except ImportError as e:
            print(f"shardprop launch: error: {e}", file=sys.stderr)
            return 2
        from .ps.launcher import run as run_ps
        return run_ps(cfg.num_servers, cfg.num_workers, cfg.log_dir, cfg.script, cfg.script_args)
    if cfg.role_env and cfg.role_env.get("SHARDPROP_PS_MODE") == "sync":
        print("shardprop launch: sync parameter-server run on jax.distributed: the tables are split by rows over "
              "the workers' devices (no separate server processes)", flush=True)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
