"""The launcher: 2 processes x 4 CPU devices form one 8-device mesh and compute
what one process computes (dumps included); failures end in bounded time with
the right status and message, and no process is left behind."""
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "launch_workers" / "behave.py"
QUICKSTART = ROOT / "examples" / "multiprocess_quickstart.py"


STACKS_AFTER_S = 45   # a rank still running then writes its threads' stacks into its log (--stacks-after)


class RunHung(AssertionError):
    """The launcher did not finish within the test's timeout; carries every rank's log."""


def launch(args, cwd, timeout=120, stacks_after=STACKS_AFTER_S, **kw):
    """Run ``shardprop launch`` and return its completed process. A run past ``timeout``
    is stopped as a user would (SIGTERM to the launcher, which stops every rank) and
    raises RunHung with the tails of the ranks' logs, their stacks included."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)   # the launcher decides the workers' device count
    cmd = [sys.executable, "-m", "shardprop.runtime.launch", "--stacks-after", str(stacks_after)] + [str(a) for a in args]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        logs = "".join(f"\n--- {f.name} (last 60 lines) ---\n" + "".join(f.read_text(errors="replace").splitlines(True)[-60:])
                       for f in sorted(Path(cwd).glob("**/workerlog.*")))
        raise RunHung(f"shardprop launch {' '.join(map(str, args))} ran past {timeout} s and was stopped\n"
                      f"launcher stderr:\n{err[-2000:]}{logs}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def launch_once_more_if_hung(args, cwd, **kw):
    """launch(), run a second time if the first hangs. The CI run of stop 32 had a
    2-process quickstart (normally 4 s) hang past 120 s once, with no log to read; of
    210 local runs under load one hung, in both ranks' native teardown after the script
    had ended, which the launcher now cuts short (--exit-grace). A hang anywhere else is
    reported as a warning carrying the ranks' stacks (--stacks-after) and the run is
    tried once more; two in a row fail."""
    try:
        return launch(args, cwd, **kw)
    except RunHung as hung:
        warnings.warn(f"a launcher run hung and was run again: {hung}")
        return launch(args, cwd, **kw)


def assert_no_orphans(pid_dir):
    for f in Path(pid_dir).glob("pid.*"):
        pid = int(f.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.multiprocess
def test_two_processes_equal_one_process(tmp_path):
    proc = launch_once_more_if_hung(["--nproc", 2, "--devices-per-proc", 4, QUICKSTART, "--out", tmp_path / "y.npy",
                                     "--dump-dir", tmp_path / "multi"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout and "coordinator 127.0.0.1:" in proc.stdout
    assert (tmp_path / "log" / "workerlog.0").exists() and (tmp_path / "log" / "workerlog.1").exists()
    # the same network in this (single) process
    sys.path.insert(0, str(ROOT / "examples"))
    import multiprocess_quickstart as mq
    import shardprop as sp
    rng = np.random.default_rng(1)
    x = rng.random((16, 32), dtype=np.float32)
    w1 = rng.standard_normal((32, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 16)).astype(np.float32)
    single = sp.parallelize(mq.net, mesh=8, dump_dir=str(tmp_path / "single"))(x, w1, w2)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), np.asarray(single), rtol=1e-6, atol=1e-6)
    multi = {p.relative_to(tmp_path / "multi"): p.read_text() for p in (tmp_path / "multi").rglob("*") if p.is_file()}
    one = {p.relative_to(tmp_path / "single"): p.read_text() for p in (tmp_path / "single").rglob("*") if p.is_file()}
    assert sorted(multi) == sorted(one)
    for name in one:
        assert multi[name] == one[name], name


@pytest.mark.multiprocess
def test_killed_rank_stops_the_others(tmp_path):
    start = time.monotonic()
    proc = launch(["--nproc", 2, "--devices-per-proc", 4, WORKER, tmp_path, "die_after_init"], cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 137
    assert "rank 1 failed (killed by SIGKILL)" in proc.stderr and "log/workerlog.1" in proc.stderr
    assert elapsed < 60   # the survivor sleeps 120 s: it was stopped, not waited for
    assert_no_orphans(tmp_path)


@pytest.mark.multiprocess
def test_rank_failing_at_startup(tmp_path):
    proc = launch(["--nproc", 2, "--devices-per-proc", 2, WORKER, tmp_path, "fail_at_start"], cwd=tmp_path)
    assert proc.returncode == 1
    assert "rank 1 failed (exit status 1)" in proc.stderr
    assert "failing on purpose" in (tmp_path / "log" / "workerlog.1").read_text()
    assert_no_orphans(tmp_path)


@pytest.mark.multiprocess
def test_sigterm_to_launcher_stops_all_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    p = subprocess.Popen([sys.executable, "-m", "shardprop.runtime.launch", "--nproc", "2", "--devices-per-proc", "2",
                          str(WORKER), str(tmp_path), "sleep"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid.*"))) < 2 or "rank 0:" not in _read(tmp_path / "log" / "workerlog.0"):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM; stopped all ranks" in err
    assert_no_orphans(tmp_path)


@pytest.mark.multiprocess
def test_a_run_that_hangs_says_where_it_waits(tmp_path):
    """--stacks-after: ranks still running write their stacks into their logs; the
    test's launch() stops such a run and reports them."""
    with pytest.raises(RunHung) as hung:
        launch(["--nproc", 2, "--devices-per-proc", 2, WORKER, tmp_path, "sleep"], cwd=tmp_path, timeout=12,
               stacks_after=3)
    report = str(hung.value)
    assert "ran past 12 s and was stopped" in report
    for rank in (0, 1):
        assert f"workerlog.{rank}" in report
    assert report.count("most recent call first") >= 2 and 'behave.py", line 30' in report
    assert_no_orphans(tmp_path)


@pytest.mark.multiprocess
def test_a_rank_that_hangs_after_finishing_is_stopped_and_the_run_succeeds(tmp_path):
    """A rank whose script and exit handlers ran (jax's shutdown barrier among them)
    but whose interpreter does not exit is stopped after --exit-grace; the run is a
    success, and the launcher says what it did."""
    start = time.monotonic()
    proc = launch(["--nproc", 2, "--devices-per-proc", 2, "--exit-grace", 3, WORKER, tmp_path, "hang_in_teardown"],
                  cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 finished (its script and exit handlers ran) but did not exit within 3 s; stopped it" in proc.stderr
    assert "rank 0: 64.0" in proc.stdout and "rank 1: 64.0" in (tmp_path / "log" / "workerlog.1").read_text()
    assert time.monotonic() - start < 60   # not the 600 s the finalizer sleeps
    assert_no_orphans(tmp_path)


def _read(path):
    try:
        return Path(path).read_text()
    except OSError:
        return ""


@pytest.mark.multiprocess
def test_devices_per_proc_that_does_not_fit_the_mesh(tmp_path):
    proc = launch(["--nproc", 2, "--devices-per-proc", 3, WORKER, tmp_path, "mesh8"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "failed (exit status" in proc.stderr
    log = (tmp_path / "log" / "workerlog.0").read_text() + (tmp_path / "log" / "workerlog.1").read_text()
    assert "needs 8 devices but jax sees 6" in log
    assert_no_orphans(tmp_path)


@pytest.mark.parametrize("args,message", [
    (["--nproc", 0, WORKER], "--nproc 0: need at least one process"),
    (["--nproc", 2, "missing_script.py"], "script 'missing_script.py' not found"),
    (["--ips", "10.0.0.1,10.0.0.2", WORKER], "cannot tell which of --ips"),
])
@pytest.mark.multiprocess
def test_bad_arguments_are_refused_before_starting(tmp_path, args, message):
    proc = launch(args, cwd=tmp_path, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "log").exists()


@pytest.mark.multiprocess
def test_busy_coordinator_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = launch(["--nproc", 2, "--port", port, WORKER, tmp_path, "ok"], cwd=tmp_path, timeout=30)
    assert proc.returncode == 2 and f"coordinator port {port} on 127.0.0.1 is already in use" in proc.stderr


@pytest.mark.multiprocess
def test_unreachable_coordinator_fails_in_bounded_time(tmp_path):
    """This host is rank 1 of a run coordinated by a host that is not there."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), SHARDPROP_INIT_TIMEOUT="5")
    env.pop("XLA_FLAGS", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardprop.runtime.launch", "--ips", "127.0.0.1,127.0.0.2", "--node-rank", "1",
                           "--port", "1", str(WORKER), str(tmp_path), "ok"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "rank 1 failed" in proc.stderr
    assert time.monotonic() - start < 90
    assert_no_orphans(tmp_path)


def test_cli_entry_point(tmp_path):
    from shardprop.compiler.cli import main
    assert main(["frobnicate"]) == 2
    assert jax.process_count() == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(480)   # its launch waits up to 180 s, twice if the first hangs
def test_training_run_across_processes_equals_one_process(tmp_path):
    proc = launch_once_more_if_hung(["--nproc", 2, "--devices-per-proc", 4, ROOT / "examples" / "quickstart_train.py"],
                                    cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    multi = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("epoch:")]
    sys.path.insert(0, str(ROOT / "examples"))
    import io

    import quickstart_train
    single = quickstart_train.train(single_device=False, file=io.StringIO())
    assert len(multi) == len(single) == 20
    np.testing.assert_allclose(multi, single, rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
def test_two_hosts_with_ips(tmp_path):
    """--ips: the same command on every host, each finding its node rank; here both
    'hosts' are this machine, told their rank with --node-rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    procs = []
    for node in (0, 1):
        host_dir = tmp_path / f"host{node}"
        host_dir.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "shardprop.runtime.launch", "--ips", "127.0.0.1,127.0.0.1", "--node-rank", str(node),
             "--port", str(port), "--nproc", "1", "--devices-per-proc", "4", str(QUICKSTART),
             "--out", str(tmp_path / "y.npy"), "--dump-dir", str(tmp_path / "dumps")],
            cwd=host_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "node 0 of 2" in outs[0][0] and "node 1 of 2" in outs[1][0]
    assert (tmp_path / "host1" / "log" / "workerlog.1").exists()
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir() if p.name.startswith("rank_")) == \
        [f"rank_{r}" for r in range(8)]
    rng = np.random.default_rng(1)
    x = rng.random((16, 32), dtype=np.float32)
    w1 = rng.standard_normal((32, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 16)).astype(np.float32)
    want = np.maximum(x @ w1, 0) @ w2
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-4, atol=1e-4)
