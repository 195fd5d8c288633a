"""What a collective after compute costs on forced CPU devices, by group size and by how
many collectives wait on the same compute: the figures the cost model's one wait
(``CostModel.sync_s``: measured over every device, paid by every collective after
compute) stands for.

Chains of 16 compute phases (``calibrate``'s layer-like phase of one block, 32 x 128
per device) on a 4 x 2 ("dp", "mp") mesh, each phase followed by k all_gathers of a
row (XLA:CPU does not combine all_gathers, calibrate's ``combined_kinds``) over the
8 devices, over "dp" (groups of 4) or over "mp" (groups of 2), that the next phase
waits for; against the phases alone, all in turns (medians). Per phase: what the k
collectives add. Their bytes are nothing: this is the wait and the launch.

    python bench/collective_wait.py            # 31 rounds
    python bench/collective_wait.py --reps 61
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardprop.compiler.calibrate import PHASE_SHAPE, _phase  # noqa: E402
from shardprop.passes.cost import CostModel  # noqa: E402

CHAIN = 16
GROUPS = (("dp", "mp"), ("dp",), ("mp",))


def chain(mesh, axes: tuple, k: int, blocks: int = 1):
    """CHAIN phases, each followed by ``k`` all_gathers over ``axes`` the next phase reads."""
    rows, width = PHASE_SHAPE

    def body(x):
        a = x.reshape(rows, width)
        w = jnp.eye(width, dtype=x.dtype) * 0.5
        for _ in range(CHAIN):
            a = _phase(a, w, blocks)
            if k:
                s = sum(lax.all_gather(a[j:j + 1], axes, tiled=True).sum() for j in range(k))
                a = a + s * 1e-9
        return a.reshape(-1)
    spec = P(("dp", "mp"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=31)
    a = ap.parse_args()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "mp"))
    x = jnp.ones(8 * PHASE_SHAPE[0] * PHASE_SHAPE[1], np.float32)
    fns = {("-", 0): chain(mesh, ("dp",), 0)}
    for axes in GROUPS:
        for k in (1, 4):
            fns[(",".join(axes), k)] = chain(mesh, axes, k)
    for f in fns.values():
        jax.block_until_ready(f(x))
    times = {key: [] for key in fns}
    for _ in range(a.reps):
        for key, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            times[key].append(time.perf_counter() - t)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    base = med[("-", 0)]
    cpu = CostModel.builtin("cpu")
    print(f"phases alone: {base / CHAIN * 1e6:.1f} us each; load average {os.getloadavg()[0]:.1f}; "
          f"the cpu profile's wait after compute (sync_s) {cpu.sync_s * 1e6:.0f} us per collective")
    print(f"{'group':<8} {'1 gather':>10} {'4 gathers':>10} {'each of 3 more':>15}   (us per phase, over the phase alone)")
    for axes in GROUPS:
        name = ",".join(axes)
        one, four = ((med[(name, k)] - base) / CHAIN * 1e6 for k in (1, 4))
        print(f"{name:<8} {one:>10.1f} {four:>10.1f} {(four - one) / 3:>15.1f}")


if __name__ == "__main__":
    main()
