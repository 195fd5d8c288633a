"""The worker actor: pull the rows its batch needs and the dense leaves, run the
jitted gradient step of the user's loss on that small local table, push row
gradients to the servers that own the rows."""
from __future__ import annotations

import os
import time

import numpy as np

from .layout import Layout, join_params, owners
from .rows import BatchRows


class ServerLost(RuntimeError):
    """A server did not answer: the job cannot go on without the parameters it held."""

    def __init__(self, server: int, cause: str):
        super().__init__(f"server {server} is gone ({cause})")
        self.server = server


class Worker:
    def __init__(self, index: int, num_workers: int, servers: list, layout: Layout, loss_fn, dense_template: dict,
                 batches, delay_factor: float = 1.0, optimizer=None):
        """``batches(worker, num_workers)`` is this worker's iterable of batch dicts.
        ``delay_factor`` > 1 makes each step that many times slower (a slow machine,
        for the benchmark and tests)."""
        import jax
        self.index = index
        self.servers = servers
        self.layout = layout
        self.template = jax.tree.map(np.asarray, dense_template)
        self.fields = set(layout.table_ids.values())
        self.num_workers = num_workers
        self.make_batches = batches
        self.grad = jax.jit(jax.value_and_grad(loss_fn))
        self.optimizer = optimizer        # GEO: the worker's own optimizer
        self.reset(delay_factor)

    def reset(self, delay_factor: float = 1.0, optimizer=None) -> None:
        """Back to the first batch, with fresh counters (the servers are reset by the driver);
        GEO's local optimizer replaced if one is given."""
        if optimizer is not None:
            self.optimizer = optimizer
        self.batches = iter(self.make_batches(self.index, self.num_workers))
        self.delay_factor = delay_factor
        self.last_ack = {"applied": None, "staleness": 0, "version": 0, "samples": 0}
        self.stats = {"worker": self.index, "pid": os.getpid(), "steps": 0, "samples": 0, "refused": 0,
                      "bytes_pulled": 0, "bytes_pushed": 0, "first_step_at": None, "last_step_at": None,
                      "losses": []}

    def pid(self) -> int:
        return os.getpid()

    def _call(self, method: str, args_per_server: list) -> list:
        import ray
        refs = [getattr(s, method).remote(*a) for s, a in zip(self.servers, args_per_server)]
        out = []
        for s, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                raise ServerLost(s, type(e).__name__) from None
        return out

    def step(self) -> dict:
        """One pull-gradient-push; returns server 0's acknowledgement."""
        start = time.perf_counter()
        if self.stats["first_step_at"] is None:
            self.stats["first_step_at"] = time.time()
        batch = next(self.batches)
        rows = BatchRows(batch, self.fields)
        lay = self.layout
        where = {}   # table -> (owner of each unique id)
        requests = [dict() for _ in self.servers]
        for t, f in lay.table_ids.items():
            where[t] = owners(rows.unique[f], lay.table_bounds[t])
            for s in range(lay.num_servers):
                requests[s][t] = rows.unique[f][where[t] == s]
        pulled = self._call("pull", [(r,) for r in requests])
        versions = [v for v, _, _ in pulled]
        dense = {}
        for _, d, _ in pulled:
            dense.update(d)
        local = {}
        for t, f in lay.table_ids.items():
            dim = pulled[0][2][t].shape[1:]
            table = np.zeros((rows.padded_rows(f),) + dim, np.float32)
            n = len(rows.unique[f])
            for s in range(lay.num_servers):
                table[:n][where[t] == s] = pulled[s][2][t]
            local[t] = table
        self.stats["bytes_pulled"] += sum(a.nbytes for a in dense.values()) + sum(
            r.nbytes for _, _, rs in pulled for r in rs.values())
        loss, grads = self.grad(join_params(self.template, local, dense), rows.batch)
        import jax
        dense_grads = {jax.tree_util.keystr(p): np.asarray(g) for p, g in
                       jax.tree_util.tree_flatten_with_path({k: v for k, v in grads.items() if k not in local})[0]}
        samples = len(next(iter(batch.values())))
        pushes = []
        for s in range(lay.num_servers):
            sparse = {}
            for t, f in lay.table_ids.items():
                n = len(rows.unique[f])
                mine = where[t] == s
                sparse[t] = (rows.unique[f][mine], np.asarray(grads[t])[:n][mine])
            dg = {k: dense_grads[k] for k in lay.dense_on(s)}
            self.stats["bytes_pushed"] += sum(g.nbytes for g in dg.values()) + sum(
                i.nbytes + g.nbytes for i, g in sparse.values())
            pushes.append((self.index, versions[s], dg, sparse, samples))
        acks = self._call("push", pushes)
        self.stats["refused"] += sum(1 for a in acks if a["applied"] is False)
        self.stats["steps"] += 1
        self.stats["samples"] += samples
        self.stats["losses"].append(float(loss))
        spent = time.perf_counter() - start
        if self.delay_factor > 1:
            time.sleep((self.delay_factor - 1) * spent)
        self.stats["last_step_at"] = time.time()
        return acks[0]

    def run(self, samples_budget: int, log_every: int = 0) -> dict:
        """Async: step until the servers have seen ``samples_budget`` samples in all
        (printing progress every ``log_every`` steps, if given)."""
        while True:
            ack = self.step()
            if log_every and self.stats["steps"] % log_every == 0:
                print(f"worker {self.index}: step {self.stats['steps']}, loss {self.stats['losses'][-1]:.4f}, "
                      f"{ack['samples']} samples seen by the servers, staleness {ack['staleness']}", flush=True)
            if ack["samples"] >= samples_budget:
                return self.report()

    def params(self) -> dict:
        """The servers' current parameters, whole (for evaluating; costs the tables' size)."""
        import ray
        from .layout import assemble
        return assemble(ray.get([s.state.remote() for s in self.servers]), self.template)

    def report(self) -> dict:
        """Counters; ``samples_per_s`` over wall-clock time from this worker's first step to
        its last, waits for other workers (sync) included."""
        out = dict(self.stats)
        span = (out["last_step_at"] - out["first_step_at"]) if out["steps"] else 0.0
        out["seconds"] = span
        out["samples_per_s"] = out["samples"] / span if span > 0 else 0.0
        return out
