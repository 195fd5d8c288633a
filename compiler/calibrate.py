"""``shardprop calibrate``: measure this machine's cost model with jax itself.

Every collective the planner emits (all_reduce, all_gather, reduce_scatter,
all_to_all, permute) is timed over every distinct group of devices the mesh's axes
make (each axis, and each set of axes), at a few buffer sizes; latency and
bandwidth are fitted per group and per kind by non-negative least squares
(``scipy.optimize.nnls``: time = latency + wire bytes / bandwidth, wire bytes as the
planner counts them); a kind keeps a fit of its own only where the group's fit
over every kind misses its times by more than 50% on average, or by more than 25% on
the same side at every size (timings on a busy machine are noisy, and a kind's three
points alone would follow the noise; noise does not fall on one side every time). Matmuls
of several shapes, square and skinny (few rows against a wide weight), running on
every device at once, give the contraction's two rates: time = flops / matmul rate +
operand and result bytes / streaming rate (a skinny matmul does little arithmetic per
byte it packs); fused loops of elementwise ops (one more in a row against one, at
three sizes) give the memory rate, counted as the model counts a fused loop: its input
read and its output written once (``passes/fusion.py``). The same matmuls and loops
run on one device alone, in turns with the all-devices runs, give one device's rates
alone (``CostModel.alone``): where the devices share a host's cores, the ratio of the two
is how much the devices slow each other, measured rather than assumed from devices over
cores (on a 16-core host, 8 forced devices each ran matmuls at a third of one device's
rate alone). A Python driver's cost per jitted program dispatched, and per
``jax.device_put`` to another device, neither waited for, is timed too (``dispatch_s``,
``transfer_s``: what the MPMD pipeline's driver pays per instruction), and a chain of one
dense layer's forward and backward (a pipeline stage's working set and op mix) on 1, 2, 4,
... and all devices at once gives how many devices' work the host gets done with that many
busy (``at_once``: 8 forced devices on 2 shared cores did about
one device's work, whatever the count). Each time is the
median of repetitions; a
collective's is the difference between a program that runs it 9 times in a row and
one that runs it once, over 8 (what a program costs to start is no collective's), the
two run in turns. The wait a collective after compute adds (``waits``, per group; ``sync_s``,
every device's) is timed by
``wait_clock``: where the devices outnumber the host's cores, CPU seconds over the
cores, since a device waiting there leaves its core to a sibling's work.

    shardprop calibrate --mesh 8 -o profile.json        # 2x2x2, prices any mesh of 8 devices
    shardprop calibrate --mesh 2x4 --cpu                # forced CPU devices
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import statistics
import sys
import time

import numpy as np

from ..passes.cost import COLLECTIVES, ComputeRates, CostModel, Link, group_shape, wire_bytes

SIZES = (256, 4096, 32768)          # float32 elements per device per collective
# (m, k, n) of an [m, k] @ [k, n] matmul per device: square ones, and skinny ones whose
# few rows meet a wide weight (a batch or sequence split leaves those)
MATMUL_SHAPES = ((128, 128, 128), (256, 256, 256), (256, 256, 128), (512, 64, 512), (32, 256, 1024),
                 (16, 512, 512))
ELEMENTWISE_SIZES = (1 << 16, 1 << 18, 1 << 21)
FUSED_CHAIN = 6                      # elementwise ops in a row, one multiply or add each
CHAIN = 8                            # collectives in a row, against one alone
# a step's compute between two collectives, as the sync measurement runs it: rows x width
# per device, and how many layer-like blocks (four independent matmul branches, then a
# normalization) make one phase
PHASE_SHAPE = (32, 128)
PHASE_BLOCKS = (1, 4, 16)
KIND_APART = 0.5                     # a kind gets its own fit where the group's misses it by more,
KIND_BIASED = 0.25                   # or misses it by more than this in the same direction at every size
# the layer whose forward and backward, chained, time devices running at once: a
# micro-batch's few rows against a whole 4 MiB weight, as a pipeline stage runs (the host
# model is at_once's only reader); streaming the weight, it shares the memory system as a
# stage does, where a square in-cache matmul would show more devices' work done at once
# than a stage gets; and its backward's matmuls with a transposed operand, which on the
# 2-core host overlapped less than the plain matmul (docs/results/pipeline.md)
AT_ONCE_SHAPE = (32, 1024, 1024)
DISPATCHES = 200                     # programs (and transfers) the driver issues per timed sample


def parse_mesh(text: str) -> tuple:
    """"8" -> the prime axes parallelize(mesh=8) uses; "2x4" -> those sizes."""
    from ..ir.mesh import prime_factors
    try:
        sizes = [int(s) for s in text.lower().split("x")]
    except ValueError:
        raise SystemExit(f"shardprop calibrate: --mesh {text!r} is not a device count or sizes like 2x4") from None
    if any(s < 1 for s in sizes):
        raise SystemExit(f"shardprop calibrate: --mesh {text!r}: sizes must be positive")
    if len(sizes) == 1:
        sizes = prime_factors(sizes[0]) or [1]
    return tuple(sizes)


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def wait_clock(devices, clock: str = "wall"):
    """What a wait costs a step on ``devices`` is measured by. ``"wall"`` (the default):
    the wall clock, what a user waits for and what ``bench/compare.py`` times. ``"cpu"``:
    where CPU devices outnumber the host's cores (forced CPU devices: 8 threads on 2
    cores), the process's CPU seconds over its cores. There a device that waits at a
    collective leaves its core to a sibling device's work, so the wait costs only the CPU
    it burns; on this project's shared machine the wall clock charged plans with many
    collectives more than their CPU (2026-11-27: the 12-layer GPT step's tensor-parallel
    mix ran 1.5x data parallel's wall clock), so the default stays the wall clock."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"wait clock {clock!r}: 'wall' or 'cpu'")
    cores = host_cores()
    if clock == "cpu" and devices[0].platform == "cpu" and len(devices) > cores:
        return lambda: time.process_time() / cores
    return time.perf_counter


def _median_time(fns, x, reps: int, clock=time.perf_counter) -> list:
    """Median seconds of each of ``fns`` on ``x`` by ``clock``, run in turns (A, B, A, B,
    ...) so that a busy spell of the machine hits them alike."""
    return _median_times([(f, x) for f in fns], reps, clock)


def _median_times(calls, reps: int, clock=time.perf_counter) -> list:
    """Median seconds of each ``(f, x)`` call in ``calls``, run in turns."""
    import jax
    for f, x in calls:
        for _ in range(2):
            jax.block_until_ready(f(x))
    times = [[] for _ in calls]
    for _ in range(reps):
        for (f, x), ts in zip(calls, times):
            t = clock()
            jax.block_until_ready(f(x))
            ts.append(clock() - t)
    return [statistics.median(ts) for ts in times]


def _program(jmesh, body):
    import jax
    from jax.sharding import PartitionSpec as P
    every = P(tuple(jmesh.axis_names))
    return jax.jit(jax.shard_map(body, mesh=jmesh, in_specs=every, out_specs=every, check_vma=False))


def _collective_body(kind: str, axes: tuple, group: int, chain: int):
    """``chain`` of one collective in a row, each fed by the last (and kept from being
    simplified away: an all_reduce of a value already equal across the group would be
    a multiply), the local shape kept from one to the next."""
    import jax.numpy as jnp
    from jax import lax

    def one(x):
        if kind == "all_reduce":   # plus the rank, so the next one's input differs across the group
            return lax.psum(x, axes) + lax.axis_index(axes).astype(x.dtype)
        if kind == "all_gather":   # then keep a neighbour's block: the shape comes back
            full = lax.all_gather(x, axes, tiled=True)
            start = ((lax.axis_index(axes) + 1) % group) * x.shape[0]
            return lax.dynamic_slice_in_dim(full, start, x.shape[0])
        if kind == "reduce_scatter":
            return jnp.tile(lax.psum_scatter(x, axes, tiled=True), group)
        if kind == "all_to_all":
            return lax.all_to_all(x, axes, 0, 0, tiled=True)
        if kind == "permute":
            return lax.ppermute(x, axes, [(i, (i + 1) % group) for i in range(group)])
        raise ValueError(kind)

    def body(x):
        for _ in range(chain):
            x = one(x)
        return x
    return body


def _prefix(body, elems: int):
    """``body`` on the first ``elems`` elements of the local buffer only."""
    return lambda x: body(x[:elems])


def _fused_loops(count: int):
    """``count`` fused loops in a row, each a chain of elementwise ops (one multiply or add
    each) that XLA fuses into one pass; a barrier between loops keeps them apart."""
    from jax import lax

    def body(x):
        for _ in range(count):
            for k in range(FUSED_CHAIN):
                x = x * 0.5 if k % 2 else x + 1.0
            x = lax.optimization_barrier(x)
        return x
    return body


def _fit(samples) -> Link:
    """latency, bandwidth from (bytes, seconds) samples; neither may come out negative."""
    from scipy.optimize import nnls
    a = np.array([[1.0, b] for b, _ in samples])
    t = np.array([s for _, s in samples])
    scale = np.array([1.0, max(a[:, 1].max(), 1.0)])   # columns of like size for the solver
    (alpha, inv_beta), _ = nnls(a / scale, t)
    inv_beta /= scale[1]
    return Link(max(float(alpha), 1e-9), 1.0 / inv_beta if inv_beta > 0 else 1e15)


def _miss(link: Link, samples) -> float:
    """How far ``link`` is from measured times, on average, relative to them."""
    return statistics.mean(abs(link.time(b) - t) / max(t, 1e-9) for b, t in samples)


def _bias(link: Link, samples) -> float:
    """How far measured times lie from ``link`` in one direction: the mean relative miss
    where every size misses the same way, else 0. Noise scatters a kind's points on both
    sides of the group's fit; a kind that is really slower (or faster) than the others
    lies on one side at every size, even when each miss is small."""
    misses = [(t - link.time(b)) / max(t, 1e-9) for b, t in samples]
    one_way = all(m > 0 for m in misses) or all(m < 0 for m in misses)
    return abs(statistics.mean(misses)) if one_way else 0.0


def _own_fit(pooled: Link, samples) -> bool:
    """Whether a kind's samples get a fit of their own beside the group's."""
    return _miss(pooled, samples) > KIND_APART or _bias(pooled, samples) > KIND_BIASED


def _rate(samples) -> float:
    """Work per second from (work, seconds) samples: the slope, past a fixed cost, and
    never below what the largest sample did outright (where noise flattens the slope).
    Where noise leaves no slope at all (the fit all fixed cost), what the largest sample
    did outright."""
    link = _fit(samples)
    work, seconds = max([x for x in samples if x[1] > 0] or samples)   # the largest that took any time
    outright = work / max(seconds, 1e-12)
    return outright if link.bytes_per_s >= 1e15 else max(link.bytes_per_s, outright)


def _contraction_rates(samples) -> tuple[float, float]:
    """(flops per second, streamed bytes per second) from (flops, bytes, seconds) samples
    of one matmul each: time = flops / rate + bytes / rate, by non-negative least squares
    (a rate whose term fits as zero comes out unbounded: 1e15)."""
    from scipy.optimize import nnls
    a = np.array([[f, b] for f, b, _ in samples])
    t = np.array([s for _, _, s in samples])
    scale = a.max(axis=0)
    coef, _ = nnls(a / scale, t)
    coef = coef / scale
    return tuple(1.0 / c if c > 0 else 1e15 for c in coef)


def _matmul_body(m: int, k: int, n: int, chain: int):
    """``chain`` [m, k] @ [k, n] matmuls in a row per device, each fed by the last (its
    result cut or tiled back to [m, k]), the operands cut from the local buffer."""
    import jax.numpy as jnp

    def body(x):
        a, b = x[:m * k].reshape(m, k), x[:k * n].reshape(k, n)
        for _ in range(chain):
            y = a @ b
            a = (y[:, :k] if n >= k else jnp.tile(y, (1, k // n))) * 0.5
        return jnp.concatenate([a.reshape(-1), x[m * k:]])
    return body


def _layer_body(m: int, k: int, n: int, chain: int):
    """``chain`` forward and backward passes of a dense ``tanh`` layer per device, each fed
    by the last, as a pipeline stage runs a micro-batch: ``h = tanh(a @ w)`` ([m, k] @ [k,
    n]), then the weight's gradient ``a.T @ g`` (accumulated) and the input's ``g @ w.T``,
    which becomes the next pass's input; the operands cut from the local buffer."""
    import jax.numpy as jnp

    def body(x):
        a, w = x[:m * k].reshape(m, k), x[:k * n].reshape(k, n)
        gw = jnp.zeros_like(w)
        for _ in range(chain):
            h = jnp.tanh(a @ w)
            g = 1.0 - h * h
            gw = gw + a.T @ g
            a = (g @ w.T) * 0.5
        return x.at[:m * k].set(a.reshape(-1)).at[:k * n].add(gw.reshape(-1) * 1e-6)
    return body


def calibrate(mesh_shape: tuple, reps: int = 7, sizes=SIZES, kinds=COLLECTIVES, log=None, wait: str = "wall") -> CostModel:
    import jax
    from jax.sharding import Mesh as JaxMesh

    from ..ir.mesh import Mesh
    names = tuple(f"d{i}" for i in range(len(mesh_shape)))
    n = math.prod(mesh_shape)
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"shardprop calibrate: the mesh needs {n} devices but jax sees {len(devices)} "
                         f"({devices[0].platform}); pass --cpu to force CPU devices")
    jmesh = JaxMesh(np.array(devices[:n]).reshape(mesh_shape), names)
    mesh = Mesh(names, tuple(mesh_shape))
    say = log or (lambda *_: None)
    t_start = time.perf_counter()

    def timed(body, local_elems: int, *more, clock=time.perf_counter) -> float:
        x = np.ones(n * local_elems, np.float32)
        x = jax.device_put(x, jax.sharding.NamedSharding(jmesh, jax.sharding.PartitionSpec(names)))
        out = _median_time([_program(jmesh, f) for f in (body, *more)], x, reps, clock)
        return out if more else out[0]

    links, pooled_all = [], []
    seen = set()
    axes_sets = [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]
    for axes in axes_sets:
        group = group_shape(axes, mesh)
        if not group or group in seen:
            continue
        seen.add(group)
        g = mesh.axes_size(axes)
        by_kind = {}
        for kind in kinds:
            samples = []
            for s in sizes:
                # one more collective in a row is what one collective costs (the program's
                # dispatch and the rest cancel)
                long, short = timed(_collective_body(kind, axes, g, 1 + CHAIN), s, _collective_body(kind, axes, g, 1))
                t = (long - short) / CHAIN
                samples.append((wire_bytes(kind, 4 * s, g), max(t, 0.0)))
            by_kind[kind] = samples
        pooled = _fit([x for samples in by_kind.values() for x in samples])
        links.append((group, "", pooled))
        say(f"  {'(every kind)':<15} axes {','.join(axes):<9} group {group}: latency {pooled.latency_s * 1e6:8.1f} "
            f"us, {pooled.bytes_per_s / 1e9:7.2f} GB/s")
        for kind, samples in by_kind.items():
            own = _fit(samples)
            if _own_fit(pooled, samples):   # a kind of its own only where the group's fit misses it
                links.append((group, kind, own))
                say(f"  {kind:<15} axes {','.join(axes):<9} group {group}: latency {own.latency_s * 1e6:8.1f} us, "
                    f"{own.bytes_per_s / 1e9:7.2f} GB/s")
        pooled_all += [x for samples in by_kind.values() for x in samples]
    default = _fit(pooled_all) if pooled_all else Link(5e-6, 100e9)
    clock = wait_clock(devices[:n], wait)
    waits = []   # per group: the fewer devices, the sooner their last arrives
    for axes in axes_sets:
        group = group_shape(axes, mesh)
        if group and group not in dict(waits):
            waits.append((group, _sync_time(functools.partial(timed, clock=clock), axes)))
            say(f"  a collective over {','.join(axes):<9} group {group} after compute waits "
                f"{waits[-1][1] * 1e6:.1f} us more than back to back")
    sync = dict(waits).get(group_shape(names, mesh), 0.0)
    if clock is not time.perf_counter:
        say(f"  (the waits by CPU seconds over {host_cores()} cores: the devices share them)")
    combined = _combined_kinds(jmesh)
    say(f"  the compiler combines independent {', '.join(combined) or 'collectives of no kind'} into one launch")

    together, alone = _compute_rates(jmesh, JaxMesh(np.array(devices[:1]).reshape((1,) * len(names)), names),
                                     reps)
    say(f"  matmul {together.flops_per_s / 1e9:.2f} GFLOP/s + its operands streamed at "
        f"{together.contraction_bytes_per_s / 1e9:.2f} GB/s per device, elementwise "
        f"{together.memory_bytes_per_s / 1e9:.2f} GB/s per device (all devices busy at once)")
    say(f"  one device alone: matmul {alone.flops_per_s / 1e9:.2f} GFLOP/s + {alone.contraction_bytes_per_s / 1e9:.2f}"
        f" GB/s streamed, elementwise {alone.memory_bytes_per_s / 1e9:.2f} GB/s ({alone.flops_per_s / together.flops_per_s:.2f}"
        f" and {alone.memory_bytes_per_s / together.memory_bytes_per_s:.2f} x the rates with all {n} busy)")
    at_once = _at_once(devices[:n], reps)
    say("  devices busy at once -> devices' work done (one alone = 1): "
        + ", ".join(f"{k} -> {c:.2f}" for k, c in at_once))
    cores = _cores_alone(devices[0], reps)
    say("  cores one device keeps busy alone (CPU / wall seconds): "
        + ", ".join(f"{k} {c:.2f}" for k, c in cores))
    dispatch_s, transfer_s = _driver_costs(devices[:n], reps)
    say(f"  a Python driver dispatches a jitted program in {dispatch_s * 1e6:.1f} us and a device_put to another "
        f"device in {transfer_s * 1e6:.1f} us (neither waited for)")
    device = devices[0]
    kind = getattr(device, "device_kind", device.platform)
    return CostModel(latency_s=default.latency_s, link_bytes_per_s=default.bytes_per_s,
                     flops_per_s=together.flops_per_s, memory_bytes_per_s=together.memory_bytes_per_s,
                     contraction_bytes_per_s=together.contraction_bytes_per_s, sync_s=sync, waits=tuple(waits),
                     alone=alone, dispatch_s=dispatch_s, transfer_s=transfer_s, at_once=at_once, cores_alone=cores,
                     combined_kinds=combined,
                     memory_capacity_bytes=_memory_capacity(device),
                     links=tuple(links), device_count=n, mesh_shape=tuple(mesh_shape), mesh_axes=names,
                     device_kind=f"{device.platform}:{kind}", name=f"calibrated-{device.platform}-{n}",
                     notes=f"measured by shardprop calibrate with jax {jax.__version__} in "
                           f"{time.perf_counter() - t_start:.0f} s, {time.strftime('%Y-%m-%d', time.gmtime())}; "
                           f"median of {reps} runs")


def _compute_rates(jmesh, one, reps: int) -> tuple:
    """(all devices of ``jmesh`` busy at once, ``one``'s single device alone): each a
    ``ComputeRates`` from the same matmuls and fused loops, the two meshes' programs timed
    in turns so that a busy spell of the machine hits both alike."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    names = tuple(jmesh.axis_names)

    def timed_on_both(bodies, local_elems):
        calls = []
        for jm in (jmesh, one):
            x = jax.device_put(np.ones(jm.devices.size * local_elems, np.float32),
                               NamedSharding(jm, PartitionSpec(names)))
            calls += [(_program(jm, b), x) for b in bodies]
        t = _median_times(calls, reps)
        return t[:len(bodies)], t[len(bodies):]

    # operand and result bytes as the model counts a contraction's: each at its local size
    # (one more matmul in a row is what one matmul costs, as for collectives)
    # every shape in turns on one buffer, so that a busy spell of the machine hits them alike
    bodies = [b for m, k, n in MATMUL_SHAPES for b in (_matmul_body(m, k, n, 1 + CHAIN), _matmul_body(m, k, n, 1))]
    matmuls = timed_on_both(bodies, max(max(m * k, k * n) for m, k, n in MATMUL_SHAPES))
    # a chain of elementwise ops, which XLA fuses into one pass over memory, counted as the
    # model counts it (passes/fusion.py): the loop's input read and its output written once,
    # the values between them in registers; one more loop in a row is what one loop costs
    # (the program's dispatch cancels), the sizes in turns on one buffer
    bodies = [b for s in ELEMENTWISE_SIZES for b in (_prefix(_fused_loops(1 + CHAIN), s), _prefix(_fused_loops(1), s))]
    loops = timed_on_both(bodies, max(ELEMENTWISE_SIZES))
    rates = []
    for times, loop_times in zip(matmuls, loops):
        flops, streamed = _contraction_rates([(2.0 * m * k * n, 4.0 * (m * k + k * n + m * n),
                                               max(times[2 * i] - times[2 * i + 1], 0.0) / CHAIN)
                                              for i, (m, k, n) in enumerate(MATMUL_SHAPES)])
        touched = _rate([(8.0 * s, max(loop_times[2 * i] - loop_times[2 * i + 1], 0.0) / CHAIN)
                         for i, s in enumerate(ELEMENTWISE_SIZES)])
        rates.append(ComputeRates(flops, touched, streamed))
    return tuple(rates)


def _at_once(devices, reps: int, shape=AT_ONCE_SHAPE) -> tuple:
    """``((k, work), ...)`` for k = 1, 2, 4, ... and every device: the same chain of a
    layer's forward and backward (``_layer_body``) per device on k devices at once (one
    ``shard_map``), timed in turns; ``work``
    is k times one device's time alone over the k devices' time, the devices' work alone
    that k of them busy get done at once."""
    import jax
    from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec
    m, k, n = shape
    counts = sorted({min(2 ** i, len(devices)) for i in range(len(devices).bit_length())} | {len(devices)})
    calls = []
    for c in counts:
        jm = JaxMesh(np.array(devices[:c]), ("d",))
        x = jax.device_put(np.ones(c * max(m * k, k * n), np.float32), NamedSharding(jm, PartitionSpec("d")))
        calls.append((_program(jm, _layer_body(m, k, n, 1 + CHAIN)), x))
    times = _median_times(calls, reps)
    return tuple((c, c * times[0] / t) for c, t in zip(counts, times))


def _cores_used(calls, reps: int) -> float:
    """The cores ``(f, x)`` calls keep busy: this process's CPU seconds over the wall
    seconds, each summed over ``reps`` runs of every call in turns (after a warm-up), so
    that each call counts by its time."""
    import jax
    for f, x in calls:
        jax.block_until_ready(f(x))
    cpu = wall = 0.0
    for _ in range(reps):
        for f, x in calls:
            c, t = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(x))
            cpu += time.process_time() - c
            wall += time.perf_counter() - t
    return cpu / max(wall, 1e-12)


def _cores_alone(device, reps: int) -> tuple:
    """``(("contraction", cores), ("memory", cores), ("at_once", cores))``: the cores one
    ``device`` alone keeps busy (``_cores_used``) running the calibration's matmul chains
    (every shape), its fused loops (every size), and ``_at_once``'s layer chain. XLA:CPU
    runs one program on several of the host's threads where its ops are large enough, so
    how much several devices get done at once depends on how many cores each program
    already keeps busy alone (the pipeline's host model, ``pipeline_step.core_share``)."""
    import jax
    from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec
    jm = JaxMesh(np.array([device]), ("d",))

    def calls(bodies, local_elems):
        x = jax.device_put(np.ones(local_elems, np.float32), NamedSharding(jm, PartitionSpec("d")))
        return [(_program(jm, b), x) for b in bodies]
    m, k, n = AT_ONCE_SHAPE
    return (("contraction", _cores_used(calls([_matmul_body(*s, 1 + CHAIN) for s in MATMUL_SHAPES],
                                               max(max(a * b, b * c) for a, b, c in MATMUL_SHAPES)), reps)),
            ("memory", _cores_used(calls([_prefix(_fused_loops(1 + CHAIN), s) for s in ELEMENTWISE_SIZES],
                                         max(ELEMENTWISE_SIZES)), reps)),
            ("at_once", _cores_used(calls([_layer_body(m, k, n, 1 + CHAIN)], max(m * k, k * n)), reps)))


def _driver_costs(devices, reps: int, calls: int = DISPATCHES) -> tuple:
    """(seconds per jitted program dispatched, per ``jax.device_put`` to another device)
    as a Python driver issues them, neither waited for (jax dispatches asynchronously): the
    program takes 4 small arrays and returns 4, as a stage's action takes its weights and
    activations; each sample issues ``calls`` of them in a row, and the median is taken."""
    import jax
    from jax.sharding import SingleDeviceSharding
    program = jax.jit(lambda a, b, c, d: (a + 1.0, b * 0.5, c + b, d - a))
    args = [jax.device_put(np.ones(64, np.float32), devices[0]) for _ in range(4)]
    there = [SingleDeviceSharding(devices[min(1, len(devices) - 1)]), SingleDeviceSharding(devices[0])]
    dispatch, transfer = [], []
    for _ in range(1 + reps):       # the first round compiles and warms up
        x, t = args, time.perf_counter()
        for _ in range(calls):
            x = program(*x)
        dispatch.append((time.perf_counter() - t) / calls)
        jax.block_until_ready(x)
        y, t = [x[0]], time.perf_counter()
        for i in range(calls):      # back and forth, so that each put moves the value
            y = jax.device_put(y, [there[i % 2]])
        transfer.append((time.perf_counter() - t) / calls)
        jax.block_until_ready(y)
    return statistics.median(dispatch[1:]), statistics.median(transfer[1:])


def _phase(a, w, blocks: int):
    """``blocks`` layer-like blocks: four independent matmul branches (a layer's q, k, v and
    more, which XLA may run side by side), combined, normalized, added to the input."""
    import jax.numpy as jnp
    from jax import lax
    for _ in range(blocks):
        h = [jnp.tanh(a @ (w * (i + 1))) for i in range(4)]
        h = h[0] * h[1] + h[2] * h[3]
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        a = jnp.tanh((h - m) * lax.rsqrt(v + 1e-5)) + a
    return a


def _flow_body(blocks: int, axes, chain: int, collective: bool):
    """``chain`` compute phases in a row per device, each followed (``collective``) or not by
    an all_reduce of one element over ``axes`` that the next phase waits for: a collective
    between compute phases, priced for its wait alone (its bytes are nothing)."""
    import jax.numpy as jnp
    from jax import lax
    rows, width = PHASE_SHAPE

    def body(x):
        a = x[:rows * width].reshape(rows, width)
        w = jnp.eye(width, dtype=x.dtype) * 0.5
        for _ in range(chain):
            a = _phase(a, w, blocks)
            if collective:
                a = a + lax.psum(a[0, 0], axes) * 1e-9
        return jnp.concatenate([a.reshape(-1), x[rows * width:]])
    return body


def _sync_time(timed, names) -> float:
    """What a collective over ``names`` that compute waits for costs beyond its back-to-back
    price: the devices reach it at different times (on a host whose cores are shared by the
    devices' threads, a descheduled thread holds the group up), so the group waits for its last.
    Chains of (compute phase -> one-element all_reduce over the group) against the same
    phases alone, in turns, at phases of 1, 4 and 16 layer-like blocks, less the same
    all_reduce back to back (a chain of them against one, timed by the same clock); the
    median, never negative. ``timed`` measures by ``wait_clock``: where the devices share
    the cores, CPU seconds, so a wait a sibling device's work fills costs nothing."""
    rows, width = PHASE_SHAPE
    bare = [_collective_body("all_reduce", names, 0, c) for c in (1 + CHAIN, 1)]   # (the group size is for gathers)
    alone = timed(_prefix(bare[0], 1), rows * width, _prefix(bare[1], 1))
    back_to_back = max(alone[0] - alone[1], 0.0) / CHAIN
    extra = []
    for blocks in PHASE_BLOCKS:
        bodies = [_flow_body(blocks, names, c, coll) for coll in (True, False) for c in (1 + CHAIN, 1)]
        t = timed(bodies[0], rows * width, *bodies[1:])
        per = ((t[0] - t[1]) - (t[2] - t[3])) / CHAIN
        extra.append(per - back_to_back)
    return max(statistics.median(extra), 0.0)


def _combined_kinds(jmesh) -> tuple:
    """The collective kinds the compiler merges when they do not depend on each other: a
    program with three independent collectives of a kind, on values of other shapes and
    ranks (as a step's gradients are), compiled and counted in its HLO."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    axes = tuple(jmesh.axis_names)
    n = jmesh.devices.size
    ops = {"all_reduce": ("all-reduce", lambda a: lax.psum(a, axes)),
           "reduce_scatter": ("reduce-scatter", lambda a: lax.psum_scatter(a, axes, tiled=True)),
           "all_gather": ("all-gather", lambda a: lax.all_gather(a, axes, tiled=True))}
    shapes = ((n,), (n, 4), (2 * n, 3))
    size = sum(math.prod(s) for s in shapes)
    combined = []
    for kind, (hlo_name, collective) in ops.items():
        def body(x, collective=collective):
            out, start = jnp.zeros((), x.dtype), 0
            for k, shape in enumerate(shapes):   # none computed from another's result
                part = x[start:start + math.prod(shape)].reshape(shape) * (k + 1.0)
                out, start = out + collective(part).sum(), start + math.prod(shape)
            return jnp.broadcast_to(out, x.shape)
        text = _program(jmesh, body).lower(jax.ShapeDtypeStruct((n * size,), np.float32)).compile().as_text()
        launched = sum(line.count(f" {hlo_name}(") + line.count(f" {hlo_name}-start(") for line in text.splitlines())
        if launched < len(shapes):
            combined.append(kind)
    return tuple(combined)


def _memory_capacity(device):
    try:
        stats = device.memory_stats() or {}
    except Exception:   # CPU devices have none; jax raises or returns None depending on version
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="shardprop calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="8", help="a device count (its prime axes, as parallelize(mesh=8) makes) or "
                                               "sizes such as 2x4 (default: 8)")
    ap.add_argument("-o", "--output", default="profile.json", help="the profile to write (default: profile.json)")
    ap.add_argument("--cpu", action="store_true", help="force as many CPU devices as the mesh needs")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per measurement, median taken (default: 7)")
    ap.add_argument("--wait-clock", choices=("wall", "cpu"), default="wall",
                    help="time the wait a collective after compute adds by the wall clock (default) or, where "
                         "forced CPU devices outnumber the cores, by CPU seconds over the cores")
    ap.add_argument("--quick", action="store_true", help="two sizes, 3 runs each, all_reduce and all_gather only "
                                                         "(a smoke test, not a profile to trust)")
    args = ap.parse_args(argv)
    shape = parse_mesh(args.mesh)
    if args.cpu:
        import jax
        from ..runtime.distributed import use_cpu_devices
        use_cpu_devices(math.prod(shape))
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", math.prod(shape))
    kw = dict(reps=3, sizes=SIZES[:2], kinds=("all_reduce", "all_gather")) if args.quick else dict(reps=args.reps)
    t = time.perf_counter()
    print(f"calibrating on mesh {'x'.join(map(str, shape))} ...", flush=True)
    model = calibrate(shape, log=lambda s: print(s, flush=True), wait=args.wait_clock, **kw)
    model.save(args.output)
    print(f"wrote {args.output} ({len(model.links)} links) in {time.perf_counter() - t:.0f} s; use it with "
          f"parallelize(..., cost_model=CostModel.load({args.output!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
