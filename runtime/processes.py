"""Child processes a launcher starts and stops: each in a session of its own, its
output to a log file (and, for one of them, to the console), stopped by process group
(SIGTERM, then SIGKILL), so nothing outlives the run. Used by ``shardprop launch``
(runtime/launch.py) and its parameter-server form (runtime/ps/launcher.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 2.0       # between SIGTERM and SIGKILL
POLL_S = 0.1


def start_logged(cmd: list, env: dict, log_path: str, console: bool = False):
    """Start ``cmd`` in a session of its own (so ``stop_groups`` reaches its children too),
    its output to ``log_path`` and, with ``console``, also to this process's stdout.
    Returns (the process, the thread copying its output, or None)."""
    if console:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        t = threading.Thread(target=_tee, args=(p.stdout, open(log_path, "w")), daemon=True)
        t.start()
        return p, t
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), None


def stop_groups(procs: list, grace: float = GRACE_S) -> None:
    """SIGTERM each process's group, then SIGKILL whatever is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        if all(p.poll() is not None for p in procs):
            break
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _tee(stream, log) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        sys.stdout.write(text)
        sys.stdout.flush()
        log.write(text)
        log.flush()
    log.close()


def describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def show_tail(path: str, lines: int = 15) -> None:
    try:
        with open(path, errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError:
        return
    if tail:
        print(f"--- last lines of {path} ---", file=sys.stderr)
        sys.stderr.writelines(tail)
        sys.stderr.flush()
