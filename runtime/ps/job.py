"""The driver of a parameter-server job: starts the server and worker actors on
Ray, runs them asynchronously (each worker at its own pace until the servers have
seen the sample budget) or synchronously (every step waits for every worker), and
watches for failures. A dead worker is reported and the job goes on without it;
a dead server stops the job with ParameterServerError (the rows it held are gone).
Every actor, and the local Ray cluster if this job started it, is stopped on exit."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .layout import Layout, assemble, split_params
from .ray_env import ParameterServerError, actor_options, connect
from .server import ParameterServer
from .staleness import merge
from .geo_worker import GeoWorker, check_stateless
from .worker import ServerLost, Worker

POLL_S = 0.2
MODES = ("async", "sync", "geo")   # geo: k local steps per worker, then its delta (asynchronous GEO)


@dataclass
class TrainResult:
    mode: str
    seconds: float
    workers: list                 # each worker's report (samples, seconds, samples_per_s, bytes, ...)
    failures: list = field(default_factory=list)   # messages about workers that died
    staleness: dict = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(w["samples"] for w in self.workers)

    def bytes_per_sample(self) -> float:
        moved = sum(w["bytes_pulled"] + w["bytes_pushed"] for w in self.workers)
        return moved / max(1, self.samples)


class Job:
    """A parameter-server training job.

    ``loss_fn(params, batch)``: the user's scalar loss, on the full parameter dict.
    ``tables``: table name (a top-level key of ``params``) -> the batch field of its ids.
    ``batches(worker, num_workers)``: a worker's iterable of batches (numpy dicts).
    ``optimizer``: optax, applied on the servers.
    """

    def __init__(self, loss_fn: Callable, params: dict, tables: dict, batches: Callable, optimizer, *,
                 num_servers: int = 1, num_workers: int = 2, mode: str = "async",
                 max_staleness: Optional[int] = 16, k_steps: Optional[int] = None,
                 slow_workers: Optional[dict] = None, log: Callable = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: one of {MODES}")
        if mode == "geo":
            GeoWorker.check_k_steps(k_steps)
            check_stateless(optimizer)
        elif k_steps is not None:
            raise ValueError(f"k_steps={k_steps} is for mode='geo' (this job's mode is {mode!r})")
        self.k_steps = k_steps
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: need at least one worker")
        self.loss_fn, self.tables, self.batches, self.optimizer = loss_fn, dict(tables), batches, optimizer
        self.num_servers, self.num_workers, self.mode = num_servers, num_workers, mode
        self.max_staleness = max_staleness
        self.slow_workers = dict(slow_workers or {})
        self.log = log or (lambda msg: print(f"shardprop ps: {msg}", file=sys.stderr, flush=True))
        table_arrays, dense = split_params(params, self.tables)
        self.dense_template = {k: v for k, v in params.items() if k not in self.tables}
        self.layout = Layout.build({t: a.shape for t, a in table_arrays.items()}, self.tables,
                                   {k: v.nbytes for k, v in dense.items()}, num_servers)
        self._init = (table_arrays, dense)
        self.ray = None
        self._owns_cluster = False
        self.servers, self.workers = [], []
        self.alive = []

    # -- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> "Job":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.ray, self._owns_cluster = connect()
        ray = self.ray
        server_cls = ray.remote(**actor_options())(ParameterServer)
        for s in range(self.num_servers):
            self.servers.append(server_cls.remote(s, *self.server_share(s), self.optimizer, self.mode,
                                                  self.max_staleness))
        geo = self.mode == "geo"
        worker_cls = ray.remote(**actor_options())(GeoWorker if geo else Worker)
        extra = {"optimizer": self.optimizer, "k_steps": self.k_steps} if geo else {}
        for w in range(self.num_workers):
            self.workers.append(worker_cls.remote(w, self.num_workers, self.servers, self.layout, self.loss_fn,
                                                  self.dense_template, self.batches,
                                                  self.slow_workers.get(w, 1.0), **extra))
        self.alive = list(range(self.num_workers))
        self._server_pids = ray.get([s.pid.remote() for s in self.servers])
        self._worker_pids = ray.get([w.pid.remote() for w in self.workers])

    def server_share(self, s: int) -> tuple:
        """Server ``s``'s initial rows of each table and its dense leaves."""
        tables, dense = self._init
        bounds = self.layout.table_bounds
        shard = {t: (int(bounds[t][s]), a[bounds[t][s]:bounds[t][s + 1]]) for t, a in tables.items()}
        return shard, {k: dense[k] for k in self.layout.dense_on(s)}

    def reset(self, mode: Optional[str] = None, slow_workers: Optional[dict] = None, optimizer=None) -> None:
        """Start over from the initial parameters on the same actors (no restart): for
        comparing modes, a slow worker against none, or optimizers (sync at a scaled
        learning rate), side by side in one run."""
        if mode is not None:
            if (mode == "geo") != (self.mode == "geo"):
                raise ValueError(f"reset(mode={mode!r}): a {self.mode!r} job's workers cannot switch to {mode!r} "
                                 f"(GEO workers keep their own copies); start another Job")
            if mode not in MODES:
                raise ValueError(f"mode={mode!r}: one of {MODES}")
            self.mode = mode
        if slow_workers is not None:
            self.slow_workers = dict(slow_workers)
        if optimizer is not None:
            if self.mode == "geo":
                check_stateless(optimizer)
            self.optimizer = optimizer
        ray = self.ray
        ray.get([server.reset.remote(*self.server_share(s), self.mode, optimizer)
                 for s, server in enumerate(self.servers)])
        ray.get([self.workers[w].reset.remote(self.slow_workers.get(w, 1.0), optimizer) for w in self.alive])

    def close(self) -> None:
        if self.ray is None:
            return
        for actor in self.workers + self.servers:
            try:
                self.ray.kill(actor)
            except Exception:   # already dead
                pass
        if self._owns_cluster:
            self.ray.shutdown()
        self.ray = None

    def server_pids(self) -> list:
        return list(self._server_pids)

    def worker_pids(self) -> list:
        return list(self._worker_pids)

    # -- training ---------------------------------------------------------------------
    def train(self, samples: int) -> TrainResult:
        """Train until the servers have seen ``samples`` samples (from all workers)."""
        start = time.perf_counter()
        reports, failures = (self._train_sync if self.mode == "sync" else self._train_async)(samples)
        stats = self.ray.get([s.stats.remote() for s in self.servers])
        return TrainResult(self.mode, time.perf_counter() - start, reports, failures,
                           merge([s["staleness"] for s in stats]))

    def _train_async(self, samples: int):
        ray = self.ray
        running = {self.workers[w].run.remote(samples): w for w in self.alive}
        reports, failures = [], []
        while running:
            done, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
            for ref in done:
                w = running.pop(ref)
                try:
                    reports.append(ray.get(ref))
                except Exception as e:   # the worker, or a server it called, died
                    failures.append(self._worker_failed(w, e))
        return reports, failures

    def _train_sync(self, samples: int):
        ray = self.ray
        failures = []
        seen = 0
        while seen < samples and self.alive:
            steps = {self.workers[w].step.remote(): w for w in self.alive}
            for ref, w in steps.items():
                try:
                    seen = max(seen, ray.get(ref)["samples"])
                except Exception as e:
                    failures.append(self._worker_failed(w, e))
            try:
                ray.get([s.apply_accumulated.remote() for s in self.servers])
            except ray.exceptions.RayActorError as e:
                self._check_servers(cause=e)
        reports = []
        for w in list(self.alive):
            try:
                reports.append(ray.get(self.workers[w].report.remote()))
            except Exception as e:
                failures.append(self._worker_failed(w, e))
        return reports, failures

    def _worker_failed(self, w: int, error: Exception) -> str:
        """A worker's call failed: if a server is gone, stop the job; else carry on without the worker."""
        self._check_servers(cause=error)
        if w in self.alive:
            self.alive.remove(w)
        if not isinstance(error, self.ray.exceptions.RayActorError):
            # the worker raised (its own bug, e.g. in the loss): that is not a machine failure
            self.close()
            raise ParameterServerError(f"worker {w} failed: {error}") from error
        msg = (f"worker {w} (pid {self._worker_pids[w]}) died ({type(error).__name__}); the "
               f"{self.num_servers} server(s) and {len(self.alive)} other worker(s) carry on")
        self.log(msg)
        if not self.alive:
            self.close()
            raise ParameterServerError(f"every worker died; the last: {msg}")
        return msg

    def _check_servers(self, cause: Exception = None) -> None:
        ray = self.ray
        for s, server in enumerate(self.servers):
            try:
                ray.get(server.ping.remote(), timeout=30)
            except Exception as e:
                lost = isinstance(cause, ServerLost) and cause.server == s
                rows = ", ".join(f"{t} rows {self.layout.table_bounds[t][s]}-{self.layout.table_bounds[t][s + 1] - 1}"
                                 for t in self.tables)
                msg = (f"parameter server {s} (pid {self._server_pids[s]}; {rows}) died "
                       f"({type(e).__name__}{', seen by a worker' if lost else ''}): the parameters it held are "
                       f"gone, so the job is stopped")
                self.log(msg)
                self.close()
                raise ParameterServerError(msg) from None

    def progress(self) -> int:
        """Samples the servers have seen so far (server 0's count; every push reaches every server)."""
        return self.ray.get(self.servers[0].stats.remote())["samples"]

    # -- results ----------------------------------------------------------------------
    def params(self) -> dict:
        """The trained parameters, assembled from every server."""
        return assemble(self.ray.get([s.state.remote() for s in self.servers]), self.dense_template)
