"""``python -m shardprop.runtime.bootstrap script.py [args...]``: how ``shardprop launch``
starts each rank. It joins the run first (runtime/distributed.py reads the launcher's
environment: coordinator, process count, this process's id), then runs the script as
``__main__``, as ``python script.py`` would: so the script may ask jax for devices on
its first line, before it calls anything of shardprop's.

A rank whose script fails exits at once with its status: a joined process would
otherwise wait at exit for its peers (jax.distributed's shutdown barrier), and the
launcher, which stops the others when one rank fails, would never hear of it.

A rank whose script ends well does what the interpreter's exit does first, in its
order: it waits for its other threads, then runs the exit handlers (jax's among them,
with its shutdown barrier: every rank has finished then). Then it leaves a mark for
the launcher (``ENV_FINISHED_MARK``): only the interpreter's own teardown is left, and a
teardown that hangs (it did, about once in 200 runs of a 2-process CPU job, in native
code) is cut short by the launcher after ``--exit-grace`` seconds.

With ``shardprop launch --stacks-after S`` a rank still running after S seconds writes
every thread's Python stack to its log, and again every S seconds: a run that hangs
(in joining, in a collective, at the exit barrier) then says where it waits.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import runpy
import sys
import threading
import traceback

from .distributed import initialize

ENV_STACKS_AFTER = "SHARDPROP_STACKS_AFTER"
ENV_FINISHED_MARK = "SHARDPROP_FINISHED_MARK"   # a file to write once the script and its exit handlers are done


def main(argv: list[str]) -> None:
    script, args = argv[0], argv[1:]
    if os.environ.get(ENV_STACKS_AFTER):
        faulthandler.dump_traceback_later(float(os.environ[ENV_STACKS_AFTER]), repeat=True, file=sys.stderr)
    try:
        joined = initialize()
    except RuntimeError as e:   # (an unreachable coordinator: say so, without a traceback)
        sys.exit(f"shardprop launch: {e}")
    sys.argv = [script] + list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(script))   # where python script.py puts it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if not joined:
            raise
        if e.code in (None, 0):
            _finish()
            raise
        status = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        _exit_now(status)
    except BaseException:
        if not joined:
            raise
        traceback.print_exc()
        _exit_now(1)
    if joined:
        _finish()


def _finish() -> None:
    """The start of the interpreter's exit, in its order: the script's other
    (non-daemon) threads joined, then the exit handlers; then the launcher's mark."""
    threading._shutdown()
    atexit._run_exitfuncs()
    mark = os.environ.get(ENV_FINISHED_MARK)
    if mark:
        with open(mark, "w"):
            pass


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
