"""Moves between pipeline ranks that live in different processes, for the MPMD lowering
(``runtime/pipeline_mpmd.py``) of a multi-process run.

jax cannot ``device_put`` onto another process's devices on CPU (it asks for the DCN
transfer server, ``jax_cross_host_transfer_socket_address``, whose CPU server aborted
with ``socket-server.cc: Check failed: num_sys_refs_ != 0`` on jax 0.10.2). A move is a
program both processes run instead: a ``shard_map`` over a two-row mesh, the sender's
devices and the receiver's, whose one ``ppermute`` sends row 0's blocks to row 1
(gloo on CPU, NCCL on GPUs). Only the two processes take part: a process that owns none
of the mesh's devices does not call it. Every process issues its moves in the driver's
order, so the two sides of every move meet (no deadlock).

A value lies on a rank as a ``jax.Array`` under one of the rank's shardings (one device;
a dp group; a planned sub-mesh); the move gives the receiver the same layout on its own
devices: each device's block goes to the device in the same position of the other rank.
The global array of the move stacks the two ranks' blocks along dim 0 (a new mesh axis
``xfer`` put in front of dim 0's axes), so each device's block is its own array, with no
reshape; a 0-d value travels as shape ``(1,)``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

XFER = "xfer"

# a block that this process's last cross-process program wrote (its token): shared by every
# MPMD program of the process, so that two pipelined steps' transfers keep their order too
_last_token = [None]


def mesh_and_spec(sharding):
    """A rank's sharding as ``(devices array, axis names, spec)``: a single device is a
    mesh of one."""
    if isinstance(sharding, SingleDeviceSharding):
        return np.asarray([next(iter(sharding.device_set))], dtype=object), ("one",), P()
    if isinstance(sharding, NamedSharding):
        return np.asarray(sharding.mesh.devices, dtype=object), tuple(sharding.mesh.axis_names), sharding.spec
    raise TypeError(f"a pipeline rank's value under {sharding!r}: expected a single device or a NamedSharding")


def mirrored(sharding, devices):
    """``sharding``'s layout on ``devices`` (another rank's, in the same mesh order)."""
    devs, axes, spec = mesh_and_spec(sharding)
    if isinstance(sharding, SingleDeviceSharding):
        return SingleDeviceSharding(np.asarray(devices, dtype=object).reshape(-1)[0])
    return NamedSharding(Mesh(np.asarray(devices, dtype=object).reshape(devs.shape), axes), spec)


def empty_like_on(shape, dtype, sharding):
    """A global array under ``sharding`` whose devices are all in other processes (what a
    process that does not own a rank holds of that rank's state)."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=np.dtype(dtype))


class Transfers:
    """The cross-process moves and broadcasts of one MPMD program, their jitted programs
    and the receivers' placeholder blocks cached by layout."""

    def __init__(self, all_devices):
        self.me = jax.process_index()
        self.all_devices = list(all_devices)       # every device of the pipeline mesh, in mesh order
        self._progs, self._zeros = {}, {}
        self.count = 0                             # cross-process programs this process has run

    # ---------------------------------------------------------------- point to point
    def _layout(self, src_sharding, dst_devices, shape):
        """The move's two-row mesh, the stacked global shape and spec, and the receiver's
        sharding of the value."""
        devs, axes, spec = mesh_and_spec(src_sharding)
        dst = np.asarray(dst_devices, dtype=object).reshape(-1)[:devs.size].reshape(devs.shape)
        mesh = Mesh(np.stack([devs, dst]), (XFER,) + axes)
        entries = list(spec) + [None] * (max(len(shape), 1) - len(spec))
        first = entries[0] if entries else None
        first = () if first is None else (first,) if isinstance(first, str) else tuple(first)
        gspec = P((XFER,) + first, *entries[1:])
        gshape = (2 * (shape[0] if shape else 1),) + tuple(shape[1:])
        return mesh, gshape, gspec, mirrored(src_sharding, dst)

    def _program(self, key, mesh, specs):
        if key not in self._progs:
            def send(tok, *xs):
                return [tok + 1] + [jax.lax.ppermute(x, XFER, [(0, 1)]) for x in xs]
            tok = P(tuple(mesh.axis_names))
            self._progs[key] = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=(tok,) + tuple(specs),
                                                     out_specs=[tok] + list(specs), check_vma=False))
        return self._progs[key]

    def _in_order(self, fn, mesh, args):
        """``fn(token, *args)``, not started before this process's previous cross-process
        program has finished. The CPU runtime starts a program when its inputs are ready,
        not in dispatch order: a receiver's inputs (placeholders) are ready at once, the
        sender's when its stage has computed the value, so two processes could start two
        transfers on a shared device in different orders, each waiting for the other
        (seen: a loss broadcast started before an earlier activation transfer). Each
        program therefore reads a token the previous one wrote (one scalar per device),
        so each process runs them in the order it dispatched them, as the other processes
        do (across every MPMD program of the process)."""
        n = mesh.devices.size
        g = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        last = _last_token[0]
        blocks = [self._zero_block((1,), np.float32, d) if last is None else jax.device_put(last, d)
                  for d in g.addressable_devices_indices_map((n,))]
        tok, *outs = fn(jax.make_array_from_single_device_arrays((n,), g, blocks), *args)
        _last_token[0] = tok.addressable_shards[0].data
        self.count += 1
        return outs

    def _zero_block(self, shape, dtype, device):
        key = (tuple(shape), np.dtype(dtype).name, device)
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(shape, dtype), device)
        return self._zeros[key]

    def move(self, values, avals, src_shardings, dst_devices):
        """Send ``values`` (on the sender: arrays under ``src_shardings``; elsewhere None)
        to ``dst_devices`` (the receiving rank's devices, mesh order) in one program.
        Returns the values on the receiver (same layouts, its devices), None elsewhere.
        Only the sender's and the receiver's processes may call it, in the same order."""
        layouts = [self._layout(s, dst_devices, tuple(a.shape)) for s, a in zip(src_shardings, avals)]
        mesh = layouts[0][0]
        sending = any(d.process_index == self.me for d in mesh.devices[0].reshape(-1))
        stacked = []
        for x, a, s_, (_, gshape, gspec, _) in zip(values, avals, src_shardings, layouts):
            g = NamedSharding(mesh, gspec)
            by_dev = {}
            if sending:
                if not x.sharding.is_equivalent_to(s_, x.ndim):
                    x = jax.device_put(x, s_)
                x = x.reshape((1,)) if not a.shape else x
                by_dev = {s.device: s.data for s in x.addressable_shards}
            block_shape = g.shard_shape(gshape)
            blocks = [by_dev[d] if d in by_dev else self._zero_block(block_shape, a.dtype, d)
                      for d in g.addressable_devices_indices_map(gshape)]
            stacked.append(jax.make_array_from_single_device_arrays(gshape, g, blocks))
        key = (tuple(mesh.devices.reshape(-1)), tuple((gs, gp, np.dtype(a.dtype).name)
                                                       for a, (_, gs, gp, _) in zip(avals, layouts)))
        outs = self._in_order(self._program(key, mesh, [g for (_, _, g, _) in layouts]), mesh, stacked)
        if sending:
            return None
        result = []
        for y, a, (_, _, _, dst_sh) in zip(outs, avals, layouts):
            by_dev = {s.device: s.data for s in y.addressable_shards}
            blocks = [by_dev[d] for d in dst_sh.addressable_devices_indices_map(tuple(a.shape) or (1,))]
            if not a.shape:
                result.append(jax.device_put(blocks[0].reshape(()), dst_sh))
            else:
                result.append(jax.make_array_from_single_device_arrays(tuple(a.shape), dst_sh, blocks))
        return result

    # ---------------------------------------------------------------- to every process
    def broadcast(self, x, aval, home_devices):
        """A value of the rank on ``home_devices`` (``x`` on its process, None elsewhere) ->
        one global array replicated on every device of the pipeline mesh (how the SPMD
        lowering returns a loss or a metric). Every process with a device of the mesh
        calls it, in the same order."""
        mesh = Mesh(np.asarray(self.all_devices, dtype=object), ("all",))
        shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
        gshape = (len(self.all_devices),) + shape
        g = NamedSharding(mesh, P("all"))
        if not any(d.process_index == self.me for d in self.all_devices):
            # a process with no device of the mesh holds no block of it (as with the SPMD lowering)
            return empty_like_on(shape, dtype, NamedSharding(mesh, P()))
        first = home_devices[0]
        blocks = [jax.device_put(x, first).reshape((1,) + shape) if d == first else
                  self._zero_block((1,) + shape, dtype, d) for d in g.addressable_devices_indices_map(gshape)]
        key = ("bcast", gshape, dtype.name)
        if key not in self._progs:
            def total(tok, y):
                y = y[0]
                return tok + 1, jax.lax.psum(y.astype(jnp.int32) if y.dtype == jnp.bool_ else y, "all").astype(y.dtype)
            self._progs[key] = jax.jit(jax.shard_map(total, mesh=mesh, in_specs=(P("all"), P("all")),
                                                     out_specs=(P("all"), P()), check_vma=False))
        return self._in_order(self._progs[key], mesh, [jax.make_array_from_single_device_arrays(gshape, g, blocks)])[0]
