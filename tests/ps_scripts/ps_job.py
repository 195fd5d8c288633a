"""One Ray session for tests/test_ps_async.py (starting Ray and the actors is the
slow part): one sync step, one GEO round; a slow worker against none, async and sync (at
the learning rate scaled by the worker count), side by side; then a worker killed mid-run; then a server killed mid-run (the job stops with
ParameterServerError, so this script ends with it). Writes results.json."""
import json
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import wide_and_deep as wd  # noqa: E402

import shardprop as sp  # noqa: E402


def flat(params):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def kill_when(job, samples, pid):
    def watch():
        while job.progress() < samples:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def main(out_dir, budget, batch):
    cfg = wd.Config.small()
    params = wd.init_params(cfg)
    log = wd.ClickLog(cfg)
    results = {}
    job = sp.ps.Job(wd.loss_fn, params, {"emb": "ids", "wide": "ids"}, wd.Batches(cfg, batch), optax.sgd(0.5),
                    num_servers=2, num_workers=3, mode="async", max_staleness=16)
    with job:
        results["pids"] = {"servers": job.server_pids(), "workers": job.worker_pids(), "driver": os.getpid()}
        job.train(batch * 30)   # compile every bucket size before timing
        # one sync step of 3 workers (batches 0, 1, 2) and one async step of worker 0 (batch 0 only)
        job.reset("sync", {})
        job.train(3 * batch)
        np.savez(os.path.join(out_dir, "sync_one_step.npz"), **flat(job.params()))
        # GEO on Ray, one worker: a round of k=3 local steps (rows pulled as batches need them) is 3 SGD steps
        with sp.ps.Job(wd.loss_fn, params, {"emb": "ids", "wide": "ids"}, wd.Batches(cfg, batch), optax.sgd(0.5),
                       num_servers=2, num_workers=1, mode="geo", k_steps=3) as geo:
            r = geo.train(3 * batch)
            np.savez(os.path.join(out_dir, "geo_k3.npz"), **flat(geo.params()))
            results["geo_k3"] = {"samples": r.samples, "pushed": r.workers[0]["bytes_pushed"]}
        # sync averages the 3 workers' gradients into one update (Paddle's merge), so at the same
        # samples it makes a third of async's updates: it gets the learning rate scaled by the
        # worker count (the linear scaling rule for a 3x larger batch)
        lr = {"async": 0.5, "sync": 0.5 * 3}
        for mode in ("async", "sync"):
            for slow in ({}, {1: 3.0}):
                job.reset(mode, slow, optax.sgd(lr[mode]))
                r = job.train(budget)
                results[f"{mode}_{'slow' if slow else 'even'}"] = {
                    "per_worker": {w["worker"]: w["samples_per_s"] for w in r.workers},
                    "steps": {w["worker"]: w["steps"] for w in r.workers},
                    "auc": wd.evaluate(job.params(), log)[1], "staleness": r.staleness,
                    "bytes_per_sample": r.bytes_per_sample()}
        job.reset("async", {}, optax.sgd(0.5))
        killer = kill_when(job, budget // 4, job.worker_pids()[2])
        r = job.train(budget)
        killer.join()
        results["kill_worker"] = {"failures": r.failures, "samples": {w["worker"]: w["samples"] for w in r.workers},
                                  "seen": job.progress()}
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
        job.reset("async", {})
        kill_when(job, budget // 4, job.server_pids()[0])
        job.train(budget)   # raises ParameterServerError


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
