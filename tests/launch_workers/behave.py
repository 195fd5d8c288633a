"""A worker for the launcher's tests. Records its pid, joins the mesh (through
parallelize, as a user's script would), then behaves as told:

    behave.py PID_DIR ok|die_after_init|fail_at_start|sleep|hang_in_teardown [RANK_THAT_MISBEHAVES]
"""
import os
import signal
import sys
import time

pid_dir, mode = sys.argv[1], sys.argv[2]
bad_rank = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rank = int(os.environ.get("SHARDPROP_PROCESS_ID", "0"))
with open(os.path.join(pid_dir, f"pid.{rank}"), "w") as f:
    f.write(str(os.getpid()))
if mode == "fail_at_start" and rank == bad_rank:
    raise SystemExit("failing on purpose before joining the mesh")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardprop as sp  # noqa: E402

step = sp.parallelize(lambda x: jnp.sum(x * 2.0), mesh=jax.device_count() if mode != "mesh8" else 8,
                   mode="data_parallel", batch_argnums=(0,))
print(f"rank {rank}: {float(step(jnp.ones((8, 4))))}", flush=True)
if mode == "die_after_init" and rank == bad_rank:
    os.kill(os.getpid(), signal.SIGKILL)
if mode in ("die_after_init", "sleep"):
    time.sleep(120)   # the others wait (as if in the next step) until the launcher stops them
if mode == "hang_in_teardown" and rank == bad_rank:
    # an object the interpreter frees only in its own teardown, after the exit handlers,
    # whose finalizer never returns (the way a native teardown can hang)
    class _Stuck:
        def __del__(self):
            time.sleep(600)
    holder = type(sys)("behave_stuck_holder")
    holder.stuck = _Stuck()
    sys.modules[holder.__name__] = holder
