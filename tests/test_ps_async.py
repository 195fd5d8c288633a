"""Parameter-server training on Ray (runtime/ps, ``sp.ps``).

The pieces without Ray: row ranges, staleness bound, the rows a push touches
updated like optax on the whole table, the message when the ``ps`` extra is
missing. With Ray (one session, tests/ps_scripts/ps_job.py, shared by the tests
below): one sync step equals the single-device step; a 3x slower worker holds
the others back in sync (lockstep, at its pace), not in async (they take more steps;
the throughput this costs is bench/ps.py's figure, not a timed test); async AUC is within 2% of sync's (sync at
the learning rate scaled by the worker count); a killed worker is reported and the
job goes on; a killed server stops the job with a clear error; no process is left
behind. The launcher: one run with a killed worker, then a killed server."""
import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import shardprop as sp
from shardprop.runtime.ps import layout, sparse_update
from shardprop.runtime.ps.rows import BatchRows, bucket
from shardprop.runtime.ps.staleness import StalenessBook

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ps_scripts" / "ps_job.py"
BATCH = 1024
BUDGET = 60 * 1024

HAVE_RAY = importlib.util.find_spec("ray") is not None    # not imported here: the jobs run in subprocesses
_skip_without_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (the 'ps' extra: pip install -e '.[ps]')")


def needs_ray(test):
    """A test on a Ray cluster: skipped without ray; marked ray and multiprocess (the cluster's
    processes); up to 600 s, since the shared session's job may take its own limit of 400 s."""
    return _skip_without_ray(pytest.mark.ray(pytest.mark.multiprocess(pytest.mark.timeout(600)(test))))


# -- without Ray ---------------------------------------------------------------------

def test_row_ranges_cover_the_table_and_need_not_divide():
    b = layout.row_bounds(10, 3)
    assert list(b) == [0, 4, 7, 10]
    ids = np.arange(10)
    assert list(layout.owners(ids, b)) == [0] * 4 + [1] * 3 + [2] * 3
    with pytest.raises(ValueError, match="table 'emb' has 2 rows, fewer than the 3 servers"):
        layout.row_bounds(2, 3, "emb")


def test_dense_leaves_spread_largest_first():
    where = layout.assign_dense({"a": 100, "b": 60, "c": 50, "d": 5}, 2)
    assert where["a"] != where["b"] and where["b"] == where["c"]


def test_staleness_bound():
    book = StalenessBook(2)
    assert book.admit(5, 5) == (True, 0) and book.admit(5, 3) == (True, 2) and book.admit(5, 2) == (False, 3)
    s = book.summary()
    assert s["applied"] == 2 and s["refused"] == 1 and s["max"] == 2 and s["histogram"] == {0: 1, 2: 1}
    with pytest.raises(ValueError, match="max_staleness=-1"):
        StalenessBook(-1)


def test_batch_rows_index_a_small_table():
    batch = {"ids": np.array([[7, 3], [3, 9]]), "x": np.ones(2)}
    rows = BatchRows(batch, {"ids"})
    assert list(rows.unique["ids"]) == [3, 7, 9]
    np.testing.assert_array_equal(rows.unique["ids"][rows.batch["ids"]], batch["ids"])
    assert rows.padded_rows("ids") == bucket(3) == 64 and bucket(65) == 128


def test_row_update_equals_optax_on_the_whole_table():
    """Adagrad on the touched rows only = adagrad on the table with zero gradient elsewhere."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((20, 4)).astype(np.float32)
    opt = optax.adagrad(0.1)
    full, full_state = jax.numpy.asarray(table), opt.init(jax.numpy.asarray(table))
    mine, state = table.copy(), sparse_update.init_state(opt, table)
    update = sparse_update.RowUpdate(opt)
    for _ in range(3):
        rows = np.sort(rng.choice(20, 6, replace=False))
        g = rng.standard_normal((6, 4)).astype(np.float32)
        dense_g = np.zeros_like(table)
        dense_g[rows] = g
        updates, full_state = opt.update(dense_g, full_state, full)
        full = optax.apply_updates(full, updates)
        state = update(mine, state, rows, g)
    np.testing.assert_allclose(mine, np.asarray(full), rtol=1e-6, atol=1e-6)


def test_without_ray_the_message_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)    # `import ray` now fails
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ps\]'"):
        sp.ps.require_ray()
    job = sp.ps.Job(lambda p, b: 0.0, {"emb": np.zeros((4, 2), np.float32), "w": np.zeros(2, np.float32)},
                    {"emb": "ids"}, lambda w, n: iter(()), optax.sgd(0.1))
    with pytest.raises(ImportError, match=r"\.\[ps\]"):
        job.start()


@pytest.mark.multiprocess
def test_import_shardprop_does_not_import_ray():
    r = subprocess.run([sys.executable, "-c", "import sys, shardprop; shardprop.ps.is_server(); "
                        "print('ray' in sys.modules)"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_bad_job_arguments():
    params = {"emb": np.zeros((4, 2), np.float32)}
    with pytest.raises(KeyError, match="tables \\['table'\\] are not top-level entries"):
        sp.ps.Job(lambda p, b: 0.0, params, {"table": "ids"}, None, optax.sgd(0.1))
    with pytest.raises(ValueError, match="mode='geo-sync'"):
        sp.ps.Job(lambda p, b: 0.0, params, {"emb": "ids"}, None, optax.sgd(0.1), mode="geo-sync")


# -- on Ray: one session shared by the tests below -------------------------------------

def _processes_with(marker: str) -> list:
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps")
    marker = f"ps-test-{uuid.uuid4()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SHARDPROP_TEST_MARK=marker)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), str(BUDGET), str(BATCH)], env=env,
                          capture_output=True, text=True, timeout=400)
    deadline = time.monotonic() + 15
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return {"proc": proc, "results": results, "left": _processes_with(marker), "out": out}


def _results(session):
    assert session["results"] is not None, session["proc"].stderr[-4000:]
    return session["results"]


@needs_ray
def test_one_sync_step_equals_the_single_device_step(session):
    sys.path.insert(0, str(ROOT / "examples"))
    import wide_and_deep as wd
    _results(session)
    cfg = wd.Config.small()
    log = wd.ClickLog(cfg)
    batch = {k: np.concatenate([log.batch(i, BATCH)[k] for i in range(3)]) for k in ("dense", "ids", "label")}
    params = wd.init_params(cfg)
    opt = optax.sgd(0.5)
    want, _, _ = jax.jit(wd.make_train_step(opt))(params, opt.init(params), batch)
    got = np.load(session["out"] / "sync_one_step.npz")
    for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]:
        np.testing.assert_allclose(got[jax.tree_util.keystr(path)], np.asarray(leaf), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@needs_ray
def test_geo_round_of_one_worker_equals_k_sgd_steps(session):
    """k_steps=3 on one worker: three local SGD steps (rows pulled when a batch first needs
    them), then the delta pushed: the servers hold what three plain steps give."""
    sys.path.insert(0, str(ROOT / "examples"))
    import wide_and_deep as wd
    assert _results(session)["geo_k3"]["samples"] == 3 * BATCH
    cfg = wd.Config.small()
    log = wd.ClickLog(cfg)
    params = wd.init_params(cfg)
    opt = optax.sgd(0.5)
    state = opt.init(params)
    step = jax.jit(wd.make_train_step(opt))
    for i in range(3):
        params, state, _ = step(params, state, log.batch(i, BATCH))
    got = np.load(session["out"] / "geo_k3.npz")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        np.testing.assert_allclose(got[jax.tree_util.keystr(path)], np.asarray(leaf), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_geo_arguments():
    params = {"emb": np.zeros((4, 2), np.float32)}
    with pytest.raises(ValueError, match="k_steps=0: each GEO worker trains k_steps local steps"):
        sp.ps.Job(lambda p, b: 0.0, params, {"emb": "ids"}, None, optax.sgd(0.1), mode="geo", k_steps=0)
    with pytest.raises(ValueError, match="optimizer keeps per-row state"):
        sp.ps.Job(lambda p, b: 0.0, params, {"emb": "ids"}, None, optax.adam(0.1), mode="geo", k_steps=10)
    with pytest.raises(ValueError, match="k_steps=10 is for mode='geo'"):
        sp.ps.Job(lambda p, b: 0.0, params, {"emb": "ids"}, None, optax.sgd(0.1), k_steps=10)


def _fast(run):
    """Median samples/s of the workers that were not slowed down (worker 1 is the slow one)."""
    return float(np.median([v for w, v in run["per_worker"].items() if w != "1"]))


@needs_ray
def test_slow_worker_holds_back_sync_not_async(session):
    """Worker 1 sleeps twice its own compute time each step. Sync runs in lockstep, so
    every worker takes as many steps as it does and the others run at its pace; async lets
    the others go on, so they take more steps than it does. Both are compared within one
    run (rates as ratios of workers that ran side by side): the machine's load slows every
    worker alike. How much throughput the slow worker costs, async against sync, is a
    figure of bench/ps.py (--part slow), not a test."""
    r = _results(session)
    sync, asyn = r["sync_slow"], r["async_slow"]
    assert len(set(sync["steps"].values())) == 1, sync["steps"]                   # lockstep
    assert _fast(sync) < 1.25 * sync["per_worker"]["1"], sync["per_worker"]      # held to its pace
    fast_steps = min(v for w, v in asyn["steps"].items() if w != "1")
    assert asyn["steps"]["1"] < 0.6 * fast_steps, asyn["steps"]                   # not held back
    assert asyn["per_worker"]["1"] < 0.6 * _fast(asyn), asyn["per_worker"]      # it really was slow
    assert asyn["staleness"]["max"] <= 16 and asyn["staleness"]["applied"] > 0


@needs_ray
def test_async_auc_is_within_2_percent_of_sync(session):
    """After the same samples, |AUC_async - AUC_sync| <= 2% of sync's, either way. Sync
    averages the workers' gradients into one update, so it runs at the learning rate times
    the worker count (ps_job.py), the rule for a larger batch."""
    r = _results(session)
    sync = r["sync_even"]["auc"]
    for run in ("async_even", "async_slow"):
        assert abs(r[run]["auc"] - sync) <= 0.02 * sync, (run, r[run]["auc"], sync)
    assert sync > 0.7     # it learned something


@needs_ray
def test_killed_worker_is_reported_and_the_others_finish(session):
    r = _results(session)["kill_worker"]
    dead = _results(session)["pids"]["workers"][2]
    assert r["failures"] == [f"worker 2 (pid {dead}) died (ActorDiedError); the 2 server(s) and 2 other "
                             f"worker(s) carry on"]
    assert sorted(r["samples"]) == ["0", "1"] and r["seen"] >= BUDGET
    assert f"worker 2 (pid {dead}) died" in session["proc"].stderr


@needs_ray
def test_killed_server_stops_the_job_with_a_clear_error(session):
    proc = session["proc"]
    assert proc.returncode == 1
    pid = _results(session)["pids"]["servers"][0]
    assert (f"ParameterServerError: parameter server 0 (pid {pid}; emb rows 0-1247, wide rows 0-1247) died"
            in proc.stderr), proc.stderr[-3000:]
    assert "the parameters it held are gone, so the job is stopped" in proc.stderr


@needs_ray
def test_no_process_is_left_behind(session):
    _results(session)
    assert session["left"] == []
    for pid in _results(session)["pids"]["servers"] + _results(session)["pids"]["workers"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- the launcher: shardprop launch --server-num N --worker-num M -----------------------

def _launch(args, cwd, env_extra=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.update(env_extra or {})
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", "shardprop.runtime.launch"] + [str(a) for a in args], cwd=cwd,
                            env=env, stdout=stdout, stderr=stderr, text=True)


def _role_pid(marker, role, index):
    for pid in _processes_with(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SHARDPROP_PS_ROLE={role}".encode() in env and f"SHARDPROP_PS_INDEX={index}".encode() in env:
            return pid
    return None


def _wait_for(text, path, proc, seconds):
    """Wait until ``path`` contains ``text`` (failing if the launcher ends first)."""
    deadline = time.monotonic() + seconds
    while text not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, (text, proc.poll())
        time.sleep(0.2)


@needs_ray
def test_launch_a_killed_worker_is_reported_a_killed_server_stops_the_run(tmp_path):
    """One script in every role on Ray, one launch for both failures (starting the
    cluster is most of the time): worker 1 killed mid-run is reported while worker 0
    and the server carry on; then server 0 killed stops the run, non-zero, naming it;
    nothing is left behind."""
    marker = f"ps-launch-{uuid.uuid4()}"
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    with open(out, "w") as o, open(err, "w") as e:   # files, not pipes: read while it runs
        p = _launch(["--server-num", 1, "--worker-num", 2, ROOT / "examples" / "ps_async.py", "--small",
                     "--samples", 10_000_000, "--batch", 1024], tmp_path, {"SHARDPROP_TEST_MARK": marker},
                    stdout=o, stderr=e)
    try:
        logs = tmp_path / "log"
        _wait_for("worker 1: step 10,", logs / "workerlog.1", p, 200)
        os.kill(_role_pid(marker, "worker", 1), 9)
        _wait_for("worker 1 failed (killed by SIGKILL); the 1 server(s) and 1 other worker(s) carry on", err, p, 60)
        steps = (logs / "workerlog.0").read_text().count("worker 0: step ")
        _wait_for(f"worker 0: step {10 * (steps + 2)},", logs / "workerlog.0", p, 60)   # it goes on training
        assert "server 0: serving emb rows 0-2495" in (logs / "serverlog.0").read_text()
        os.kill(_role_pid(marker, "server", 0), 9)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.terminate()   # the launcher stops every role and the cluster on SIGTERM
            p.wait(timeout=120)
    stderr = err.read_text()
    assert p.returncode == 128 + 9, stderr[-3000:]
    assert ("shardprop launch: server 0 ended (killed by SIGKILL) while workers were training: the parameters "
            "it held are gone, so the run is stopped. See") in stderr, stderr[-3000:]
    assert "done;" not in out.read_text()
    deadline = time.monotonic() + 15
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


@pytest.mark.multiprocess
def test_launch_sync_roles_run_on_jax_distributed(tmp_path):
    p = _launch(["--server-num", 1, "--worker-num", 2, "--ps-mode", "sync", ROOT / "tests" / "ps_scripts" /
                 "show_role.py"], tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert "tables are split by rows over the workers' devices" in out
    for i in (0, 1):
        assert f"role=worker server=False worker=True index={i} processes=2" in \
            (tmp_path / "log" / f"workerlog.{i}").read_text()


@pytest.mark.parametrize("args,message", [
    (["--worker-num", 0], "--worker-num 0: a parameter-server run needs at least one worker"),
    (["--worker-num", 2], "--server-num missing: an async parameter-server run needs at least one server"),
    (["--server-num", 1, "--worker-num", 2, "--nproc", 2], "leave out --nproc, --gpus and --ips"),
])
@pytest.mark.multiprocess
def test_launch_bad_role_arguments(tmp_path, args, message):
    p = _launch(args + [ROOT / "tests" / "ps_scripts" / "show_role.py"], tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and message in err
    assert not (tmp_path / "log").exists()


@pytest.mark.multiprocess
def test_launch_without_ray_names_the_extra(tmp_path):
    """An async run on a machine without the ``ps`` extra stops before starting anything."""
    (tmp_path / "no_ray").mkdir()
    (tmp_path / "no_ray" / "ray.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    p = _launch(["--server-num", 1, "--worker-num", 2, ROOT / "tests" / "ps_scripts" / "show_role.py"], tmp_path,
                {"PYTHONPATH": os.pathsep.join([str(tmp_path / "no_ray"), str(ROOT)])})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, err[-2000:]
    assert "runs on Ray, which is not installed" in err and "pip install -e '.[ps]'" in err
    assert not (tmp_path / "log").exists()
