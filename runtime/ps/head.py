"""The Ray cluster of one ``shardprop launch --server-num N --worker-num M`` run:
started before the roles, stopped after them. Writes the cluster's address to the
file given, then waits for SIGTERM (the launcher's) and shuts the cluster down, so
no Ray process outlives the run.

    python -m shardprop.runtime.ps.head ADDRESS_FILE
"""
from __future__ import annotations

import os
import signal
import sys
import time


def main(address_file: str) -> int:
    from .ray_env import require_ray
    ray = require_ray()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    tmp = address_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(ray.get_runtime_context().gcs_address)
    os.replace(tmp, address_file)   # readers never see half an address
    print(f"ray cluster at {ray.get_runtime_context().gcs_address}", flush=True)
    while not stop["now"]:
        time.sleep(0.1)
    ray.shutdown()
    print("ray cluster stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
