"""Lower an analysed pipeline (``compiler/pipeline_assign.py``) to one SPMD program.

The program is a ``jax.shard_map`` with the pipeline axis manual. Inside it:

1. a ``lax.scan`` over the ticks of the schedule's unit-cost tick table
   (``passes/pipeline/simulate.py``). At tick ``t`` rank ``d`` reads its row of static
   tables (action id, micro-batch, slot) and runs ``lax.switch`` over the branches
   ``[no-op, F of model stage 0, B of model stage 0, ...]``: on a bubble tick the no-op
   branch passes its buffers through and computes nothing;
2. after the switch, two ``ppermute`` exchanges: the forward send to ``d+1`` and the
   backward (cotangent) send to ``d-1`` (plus the wrap-around ``p-1 -> 0`` / ``0 -> p-1``
   with interleaved chunks). The receiver stores what arrived in the slot a static
   table names (or nowhere);
3. after the scan, a ``lax.switch`` on the rank runs the rank's ``once`` ops (the
   optimizer update on the accumulated gradients) and packs its results.

Buffers per rank, all flat float32 (other dtypes of 32 bits or less are converted or
bit-cast): ``act_in[slots, A]`` (a micro-batch's stage input), ``resid[slots, R]`` (the
forward values its backward reads), ``ct_in[slots, G]`` (the cotangent received),
``acc[ACC]`` (partial sums over micro-batches, at static offsets per model stage) and
``out_buf[m, O]`` (per-micro-batch outputs of a forward-only step). A (chunk,
micro-batch) holds one slot from the tick its input arrives to its last backward
action; slots are reused by a static interval allocation, so 1F1B keeps about ``p - d``
slots where GPipe keeps ``m``. Every rank's buffers have the largest stage's sizes (one
SPMD program): a smaller stage's values are padded with ``lax.pad`` (``_placed``), never
by concatenating a long run of zeros, which XLA CPU fuses into a loop far slower than the fill.

Parameters: each rank's state leaves (the inputs only its programs read) are packed in
one float32 row of a ``(p, size)`` array split over the pipeline axis, so a rank holds
only its own stage's parameters. Outputs computed by a rank's ``once`` ops come back
packed the same way (``PackedLeaf`` objects that index the array; passing them back to
the step reads them in place).

With a sub-mesh (``SubMesh``: the program is a per-rank program planned on the mesh axes
beside the pipeline's, ``compiler/pipeline_submesh.py``) every mesh axis is manual: the
state is a ``(p, ranks, size)`` array of each rank's local blocks, and replicated inputs,
the batch and replicated outputs go in and out under their planned layouts.

Nothing here imports ``compiler/``: the analysis is duck-typed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from ..ir.errors import ShardingError

FLOAT, MB, ONCE, MARK = "float", "mb", "once", "mark"
REP = -1
F_, B_, I_, W_ = "forward", "backward", "backward_input", "backward_weight"


# ---------------------------------------------------------------- packing
def _to_f32(x):
    x = jnp.asarray(x)
    dt = x.dtype
    if dt == jnp.float32:
        return x.reshape(-1)
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize <= 4:
        return x.astype(jnp.float32).reshape(-1)
    if dt in (jnp.int32, jnp.uint32):
        return lax.bitcast_convert_type(x, jnp.float32).reshape(-1)
    if dt == jnp.bool_ or (jnp.issubdtype(dt, jnp.integer) and dt.itemsize < 4):
        return x.astype(jnp.float32).reshape(-1)
    raise ShardingError(f"a pipeline exchanges and packs arrays of 32 bits or less; got {dt} {x.shape}")


def _from_f32(flat, shape, dtype):
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.int32, jnp.uint32):
        return lax.bitcast_convert_type(flat, dtype).reshape(shape)
    return flat.astype(dtype).reshape(shape)


def np_to_f32(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype in (np.int32, np.uint32):
        return x.reshape(-1).view(np.float32)
    return x.astype(np.float32).reshape(-1)


def np_from_f32(flat, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    flat = np.asarray(flat)
    if dtype in (np.int32, np.uint32):
        return flat.view(dtype).reshape(shape).copy()
    return flat.astype(dtype).reshape(shape)


def _literal(val):
    """A literal's value as a plain array: a per-rank program traced inside a shard_map over
    a sub-mesh keeps typed literals whose aval names that mesh, not the pipeline's."""
    return np.array(val) if isinstance(val, np.ndarray) and type(val) is not np.ndarray else val


def _row(x):
    """A rank's packed state row from its block of the state array (``(1, size)``, or
    ``(1, 1, size)`` over a sub-mesh)."""
    return x.reshape(x.shape[-1])


def _size(var) -> int:
    return int(np.prod(var.aval.shape, dtype=np.int64))


SMALL_GAP = 1024   # zeros up to this many elements are concatenated, longer runs padded


def _placed(parts, total: int):
    """A flat float32 buffer of ``total`` holding ``parts`` (``(offset, flat array)``) and
    zeros elsewhere. The parts and the short gaps between them (at most ``SMALL_GAP``
    zeros) are concatenated; a longer gap is made by ``lax.pad``: XLA CPU fuses a
    concatenate whose operands include a large zero broadcast into one loop that runs
    25-250x slower than the fill it replaces (a 4 MiB piece of four gradients and zeros:
    51 ms against 0.3 ms padded, docs/results/pipeline.md), while a pad by a few elements
    costs a bounds check on every element that a short zero operand does not."""
    runs = []          # [start, [arrays]]: parts joined across short gaps
    for off, x in sorted(parts, key=lambda t: t[0]):
        end = runs[-1][0] + sum(int(y.shape[0]) for y in runs[-1][1]) if runs else None
        if runs and 0 <= off - end <= SMALL_GAP:
            runs[-1][1].extend(([jnp.zeros((off - end,), jnp.float32)] if off > end else []) + [x])
        else:
            runs.append([off, [x]])
    out = None
    for n, (off, xs) in enumerate(runs):
        size = sum(int(y.shape[0]) for y in xs)
        lo, hi = off, total - off - size
        if lo <= SMALL_GAP and n == 0 and lo:
            xs, lo = [jnp.zeros((lo,), jnp.float32)] + xs, 0
        if hi <= SMALL_GAP and n == len(runs) - 1 and hi:
            xs, hi = xs + [jnp.zeros((hi,), jnp.float32)], 0
        run = xs[0] if len(xs) == 1 else jnp.concatenate(xs)
        run = run if lo == 0 and hi == 0 else lax.pad(run, jnp.float32(0), [(lo, hi, 0)])
        out = run if out is None else out + run
    return jnp.zeros((total,), jnp.float32) if out is None else out


class Packing:
    """Static offsets of a list of vars in a flat float32 buffer."""
    def __init__(self, vars_):
        self.vars = list(dict.fromkeys(vars_))
        self.offset, off = {}, 0
        for v in self.vars:
            self.offset[v] = off
            off += _size(v)
        self.size = off

    def pack(self, env, total):
        return _placed([(self.offset[v], _to_f32(env[v])) for v in self.vars], total)

    def unpack(self, flat, env, base=0):
        for v in self.vars:
            o = base + self.offset[v]
            env[v] = _from_f32(lax.slice_in_dim(flat, o, o + _size(v)), v.aval.shape, v.aval.dtype)


@dataclass(frozen=True)
class SubMesh:
    """The mesh axes beside the pipeline's (tensor parallel, dp) that a planned per-rank
    program runs on (``compiler/pipeline_submesh.py``): their names and sizes in mesh
    order, and per invar / outvar of the per-rank program the mesh axes of each dim
    (``Layout.dims``) and the global shape."""
    axes: tuple
    sizes: tuple
    in_dims: tuple
    out_dims: tuple
    in_shapes: tuple
    out_shapes: tuple

    @property
    def ranks(self) -> int:
        return int(np.prod(self.sizes, dtype=np.int64))

    def spec(self, dims) -> P:
        return P(*[None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in dims])

    def block(self, shape, dims, r: int) -> tuple:
        """The slices of the global ``shape`` that sub-mesh rank ``r`` (linear, mesh order)
        holds under ``dims``."""
        coord = dict(zip(self.axes, np.unravel_index(r, self.sizes))) if self.axes else {}
        size = dict(zip(self.axes, self.sizes))
        out = []
        for n, axes in zip(shape, dims):
            parts, idx = 1, 0
            for a in axes:
                parts, idx = parts * size[a], idx * size[a] + int(coord[a])
            out.append(slice(idx * (n // parts), (idx + 1) * (n // parts)))
        return tuple(out)


def pack_blocks(x, sub: SubMesh, dims) -> np.ndarray:
    """``(ranks, local size)``: each sub-mesh rank's block of the global ``x``, flat f32."""
    x = np.asarray(x)
    return np.stack([np_to_f32(x[sub.block(x.shape, dims, r)]) for r in range(sub.ranks)])


def unpack_blocks(rows, offset: int, sub: SubMesh, shape, dims, dtype) -> np.ndarray:
    """The global array of ``shape`` whose blocks under ``dims`` sub-mesh rank ``r``
    holds flat at ``rows[r, offset:]`` (``pack_blocks``' inverse)."""
    a = np.empty(shape, np.dtype(dtype))
    for r in range(sub.ranks):
        sl = sub.block(shape, dims, r)
        local = tuple(s.stop - s.start for s in sl)
        n = int(np.prod(local, dtype=np.int64))
        a[sl] = np_from_f32(rows[r, offset:offset + n], local, dtype)
    return a


@dataclass
class PackedLeaf:
    """One array of a pipeline's state, stored in row ``rank`` of ``buffer`` (a
    ``(p, size)`` float32 array split over the pipeline axis; with a sub-mesh ``sub``, a
    ``(p, ranks, size)`` array split over it too, each rank holding its block of the
    array under ``dims``). ``np.asarray`` / ``sp.to_numpy`` give its value; passing it
    back to the step reads it in place."""
    buffer: object
    rank: int
    offset: int
    shape: tuple
    dtype: object
    dims: tuple = None
    sub: SubMesh = None
    others: tuple = ()      # (rank, offset) of the other ranks that store it (a tied weight's owners)

    def offset_on(self, rank: int):
        """Its offset in row ``rank``, or None where that rank does not store it."""
        return self.offset if rank == self.rank else dict(self.others).get(rank)

    def __array__(self, dtype=None, copy=None):
        if self.sub is not None:
            a = unpack_blocks(np.asarray(self.buffer[self.rank]), self.offset, self.sub, self.shape, self.dims,
                              self.dtype)
            return a.astype(dtype) if dtype is not None else a
        held = self._held_row()
        row = np.asarray(held if held is not None else self.buffer[self.rank]).reshape(-1)
        n = int(np.prod(self.shape, dtype=np.int64))
        a = np_from_f32(row[self.offset:self.offset + n], self.shape, self.dtype)
        return a.astype(dtype) if dtype is not None else a

    def gathered(self, to_numpy):
        """Its value on every process (``sp.to_numpy``): the buffer gathered by ``to_numpy``
        (every process calls it), then read as ``np.asarray`` reads it."""
        if getattr(self.buffer, "is_fully_addressable", True):
            return np.asarray(self)
        return np.asarray(replace(self, buffer=to_numpy(self.buffer)))

    def _held_row(self):
        """Row ``rank`` from a shard of the buffer this process holds (no gather), or None.
        (The shard is found by its index: over several processes a process's shards are
        not the rows in order, and taking shard ``rank`` had read another rank's row.)"""
        if isinstance(self.buffer, np.ndarray):
            return self.buffer[self.rank]
        for shard in self.buffer.addressable_shards:
            rows = shard.index[0] if shard.index else slice(None)
            start, stop, _ = rows.indices(self.buffer.shape[0])
            if start <= self.rank < stop:
                return shard.data[self.rank - start]
        return None

    @property
    def addressable(self) -> bool:
        """Whether this process holds every block of the row that stores it (what
        ``np.asarray`` reads without the other processes)."""
        if getattr(self.buffer, "is_fully_addressable", True):
            return True
        shape = self.buffer.shape

        def key(index):   # (the blocks of the row, as the devices' indices give them)
            return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
        here = {key(sh.index) for sh in self.buffer.addressable_shards}
        row = {key(ix) for ix in self.buffer.sharding.devices_indices_map(shape).values()
               if key(ix)[0][0] <= self.rank < key(ix)[0][1]}
        return row <= here

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"PackedLeaf({np.dtype(self.dtype).name}{list(self.shape)} on pipeline rank {self.rank})"


# ---------------------------------------------------------------- the program
def rep_needed(j, rep_ops, users, once_readers, outs_at, ties, owners, untied) -> dict:
    """The ranks on which each replicated (REP) once op's results are needed, a fixed point
    shared by both lowerings: where a stage once op reads them (``once_readers``: var ->
    ranks), where a later REP op is needed (``users``: var -> REP ops reading it), and for a
    step output (``outs_at``: var -> output numbers) tied to an input (``ties``: output ->
    input number), on that input's ``owners`` (input number -> ranks, grown in place by
    the REP ops reading it); an output tied to no input is needed on ``untied``."""
    needed = {e: set() for e in rep_ops}
    changed = True
    while changed:
        changed = False
        for e in reversed(rep_ops):
            want = set()
            for o in j.eqns[e].outvars:
                want |= once_readers.get(o, set())
                for u in users.get(o, []):
                    want |= needed[u]
                for n in outs_at.get(o, []):
                    t = ties.get(n)
                    want |= owners[t] if t is not None else untied
            if not want <= needed[e]:
                needed[e] |= want
                changed = True
        for i, v in enumerate(j.invars):
            for e in users.get(v, []):
                if not needed[e] <= owners[i]:
                    owners[i] |= needed[e]
                    changed = True
    return needed


class PipelineProgram:
    """Builds and runs the pipelined step for one input signature."""

    def __init__(self, an, schedule, sim, *, mesh, axis, m, batch_mask, dp_axis=None, sub: SubMesh = None,
                 ties=None):
        """``batch_mask``: per invar, whether it is a batch argument (split into
        micro-batches). ``self.owner`` per invar: the rank whose programs alone read it
        (packed there), ``-1`` (replicated) or None (unused). ``sub``: the program is a
        planned per-rank program on these other mesh axes (every axis is manual; state,
        replicated inputs and outputs are blocks under their layouts). ``ties``: {outvar
        position: invar index} of the state outputs (the new value of an input): an input
        that only the replicated once ops and some ranks read is then stored on those ranks
        only, and its new value comes back there (``_plan_shared``)."""
        self.ties = ties
        self.an, self.schedule, self.sim = an, schedule, sim
        self.mesh, self.axis, self.m, self.dp_axis, self.sub = mesh, axis, m, dp_axis, sub
        self.p, self.v = schedule.p, schedule.v
        self.S = self.p * self.v
        j = an.jaxpr.jaxpr
        self.j = j
        self.batch_mask = batch_mask
        self.invar_index = {v: i for i, v in enumerate(j.invars)}
        self.consts = [an.const_override.get(k, c) for k, c in enumerate(an.jaxpr.consts)]
        self._plan_programs()
        self._plan_owner()
        self._plan_ticks()
        self._plan_state()
        self._plan_outputs(self.out_spec)

    # -- which eqns each branch runs and what it reads
    def _with_floats(self, idxs):
        j, roles, prod = self.j, self.an.roles, self.an.producer
        need, stack = set(idxs), list(idxs)
        while stack:
            for a in j.eqns[stack.pop()].invars:
                if isinstance(a, jcore.Literal) or a not in prod:
                    continue
                i = prod[a]
                if roles[i] == FLOAT and i not in need:
                    need.add(i)
                    stack.append(i)
        return sorted(need)

    def _reads(self, idxs):
        produced = {o for i in idxs for o in self.j.eqns[i].outvars}
        reads = []
        for i in idxs:
            for a in self.j.eqns[i].invars:
                if not isinstance(a, jcore.Literal) and a not in produced:
                    reads.append(a)
        return list(dict.fromkeys(reads))

    def _plan_sunk(self):
        """Once ops that only transpose a stage's accumulated partial sum (a weight
        gradient in the layout dot_general's transpose rule leaves) commute with the sum
        over micro-batches, so they run per micro-batch in the program that computes the
        partial sum, where XLA folds them into the dot, and the accumulator holds the
        gradient in its final layout. Left after the loop, the transpose is a strided
        read fused into every optimizer expression that reads the gradient (measured:
        most of the pipelined step at width 1024, docs/results/pipeline.md).
        Returns ``{acc var: transpose eqn index}``."""
        an, j = self.an, self.j
        readers = {}
        for i, e in enumerate(j.eqns):
            for a in e.invars:
                if not isinstance(a, jcore.Literal):
                    readers.setdefault(a, []).append(i)
        outs = {v for v in j.outvars if not isinstance(v, jcore.Literal)}
        sunk = {}
        for k in range(self.S):
            for i in an.stages[k].once:
                e = j.eqns[i]
                a = e.invars[0]
                if (e.primitive.name == "transpose" and not isinstance(a, jcore.Literal)
                        and an.kind.get(a) == "acc" and an.var_stage.get(a) == k
                        and readers.get(a) == [i] and a not in outs):
                    sunk[a] = i
        return sunk

    def _plan_programs(self):
        an, j = self.an, self.j
        self.sunk = self._plan_sunk()
        sunk_eqns = set(self.sunk.values())
        # what crosses each cut (mark operands and results, or automatic cuts' crossing sets)
        self.fwd_out, self.fwd_in = an.fwd_send, an.fwd_recv
        self.bwd_out, self.bwd_in = an.bwd_send, an.bwd_recv
        outvars = set(v for v in j.outvars if not isinstance(v, jcore.Literal))
        kinds = [F_] + ([B_] if self.schedule.name != "zero_bubble" else [I_, W_]) if an.training else [F_]
        self.kinds = kinds
        self.progs = {}
        for k in range(self.S):
            st = an.stages[k]
            ops = {F_: st.forward, B_: st.backward, I_: st.backward_input, W_: st.backward_weight}
            for kind in kinds:
                idxs = list(ops[kind])
                sends = (self.fwd_out.get(k, []) if kind == F_ and k < self.S - 1 else
                         self.bwd_out.get(k, []) if kind in (B_, I_) and k > 0 else [])
                # sent values computed by floats (a marked input) join the program
                extra = [self.an.producer[a] for a in sends if not isinstance(a, jcore.Literal)
                         and a in self.an.producer and self.an.roles[self.an.producer[a]] == FLOAT]
                idxs = self._with_floats(sorted(set(idxs) | set(extra)))
                produced = {o for i in idxs for o in j.eqns[i].outvars}
                accs = [o for i in idxs if an.roles[i] == MB for o in j.eqns[i].outvars if an.kind.get(o) == "acc"]
                # a sunk transpose runs here, and its result is what accumulates
                idxs = sorted(set(idxs) | {self.sunk[o] for o in accs if o in self.sunk})
                accs = [j.eqns[self.sunk[o]].outvars[0] if o in self.sunk else o for o in accs]
                produced = {o for i in idxs for o in j.eqns[i].outvars}
                outs_b = [o for o in produced if o in outvars and an.kind.get(o) == MB]
                self.progs[(kind, k)] = dict(idxs=idxs, reads=self._reads(idxs) + [a for a in sends
                                             if not isinstance(a, jcore.Literal) and a not in produced],
                                             sends=sends, accs=accs, outs_b=outs_b)
        # residuals: forward-produced values of stage k that its backward programs read
        self.resid = {}
        for k in range(self.S):
            fprod = {o for i in self.progs[(F_, k)]["idxs"] for o in j.eqns[i].outvars}
            r = []
            for kind in kinds[1:]:
                r += [a for a in self.progs[(kind, k)]["reads"] if a in fprod]
            self.resid[k] = Packing(r)
        self.once = {}
        for k in range(self.S):
            idxs = self._with_floats([i for i in an.stages[k].once if i not in sunk_eqns])
            self.once[k] = dict(idxs=idxs, reads=self._reads(idxs))
        self._plan_phases()

    def _plan_phases(self):
        """Once ops that combine stages (REP, ``an.rep_once``) run on every rank. Phase q:
        the REP ops of phase q, then every rank's stage once ops of phase <= q (recomputed:
        each phase's switch is a fresh program), then the stage values a later REP op reads
        go where they are needed (``_share``: a ppermute to the ranks that need them, or a
        masked psum when every rank does). A REP op reading a stage value of phase q is
        phase q+1; a stage op reading a REP value of phase q is phase q."""
        an, j = self.an, self.j
        home = {}       # var -> stage, or REP
        phase = {}      # var -> phase it is available in (REP vars) or computed in (stage vars)
        for k in range(self.S):
            for o in self.acc_vars(k):
                home[o], phase[o] = k, 0
        rep_set = set(an.rep_once)
        self.op_phase = {}
        sunk_eqns = set(self.sunk.values())
        once_ops = sorted(set(an.rep_once) | {i for k in range(self.S) for i in an.stages[k].once
                                               if i not in sunk_eqns})
        self.bcast_at = {}   # phase -> stage vars broadcast at its end
        for i in once_ops:
            eqn = j.eqns[i]
            ins = [a for a in eqn.invars if not isinstance(a, jcore.Literal) and a in home]
            if i in rep_set:
                q = max([0] + [phase[a] + (1 if home[a] != REP else 0) for a in ins])
                for a in ins:
                    if home[a] != REP:
                        self.bcast_at.setdefault(phase[a], [])
                        if a not in self.bcast_at[phase[a]]:
                            self.bcast_at[phase[a]].append(a)
            else:
                q = max([0] + [phase[a] for a in ins])
            self.op_phase[i] = q
            for o in eqn.outvars:
                home[o], phase[o] = (REP if i in rep_set else an.stage[i]), q
        self.var_home, self.var_phase = home, phase
        self.nphases = 1 + max([0] + list(self.op_phase.values()))
        self.rep_idxs = self._with_floats(an.rep_once)
        self.rep_reads = self._reads(self.rep_idxs)

    def acc_vars(self, k):
        return [o for kind in self.kinds for o in self.progs[(kind, k)]["accs"]]

    def _plan_owner(self):
        an, j = self.an, self.j
        readers = {i: set() for i in range(len(j.invars))}
        for (kind, k), prog in self.progs.items():
            for v in prog["reads"]:
                if v in self.invar_index:
                    readers[self.invar_index[v]].add(self.rank_of(k))
        for k, prog in self.once.items():
            for v in prog["reads"]:
                if v in self.invar_index:
                    readers[self.invar_index[v]].add(self.rank_of(k))
        for v in self.rep_reads:
            if v in self.invar_index:
                readers[self.invar_index[v]].add(-1)
        spec, float_outs = [], []
        for v in j.outvars:
            if isinstance(v, jcore.Literal):
                spec.append(("literal", v.val))
            elif v in self.invar_index:
                spec.append(("input", self.invar_index[v]))
            elif an.kind[v] == FLOAT:
                spec.append(("float",))
                float_outs.append(v)
            elif an.kind[v] == ONCE and an.var_stage[v] == REP:
                spec.append(("rep",))
            elif an.kind[v] in ("acc", ONCE):
                k = an.var_stage[v]
                spec.append(("bcast", k) if v.aval.ndim == 0 else ("packed", k))
                if an.kind[v] == "acc":
                    readers_once = self.once[k]
                    readers_once["reads"] = list(dict.fromkeys(readers_once["reads"] + [v]))
            else:
                spec.append(("batched", an.var_stage[v]))
        self.float_idxs = self._with_floats([self.an.producer[v] for v in float_outs])
        self.float_outs = float_outs
        for v in self._reads(self.float_idxs):
            if v in self.invar_index:
                readers[self.invar_index[v]].add(-1)
        float_read = {self.invar_index[v] for v in self._reads(self.float_idxs) if v in self.invar_index}
        self.owner = []
        for i in range(len(j.invars)):
            r = readers[i]
            self.owner.append(None if not r else "batch" if self.batch_mask[i] else
                              next(iter(r)) if len(r) == 1 and -1 not in r else -1)
        self.share_targets = {}
        if self.ties is not None:
            self._plan_shared(readers, float_read, spec)
        self.out_spec = spec

    def _plan_shared(self, readers, float_read, spec):
        """Inputs read by the replicated (REP) once ops, stored only where they are needed
        (a tied weight and its optimizer state: on its owner stages' ranks, as Paddle's
        SharedLayerDesc keeps it). A REP op's value is **needed** on the ranks whose stage
        once ops read it, where a later REP op needs it, and on the owners of the input a
        step output of it replaces; an input is stored on its stage readers' ranks and
        where a REP op reading it is needed (a fixed point). Every rank runs the REP ops;
        a rank without the input computes on zeros a value that no rank uses. The REP
        outputs tied to such an input come back packed on its owners."""
        j = self.j
        lit = lambda a: isinstance(a, jcore.Literal)   # noqa: E731
        rep_ops = list(self.rep_idxs)
        users = {}
        for e in rep_ops:
            for a in j.eqns[e].invars:
                if not lit(a):
                    users.setdefault(a, []).append(e)
        once_readers = {}
        for k, prog in self.once.items():
            for v in prog["reads"]:
                once_readers.setdefault(v, set()).add(self.rank_of(k))
        outs_at = {}
        for n, v in enumerate(j.outvars):
            if not lit(v):
                outs_at.setdefault(v, []).append(n)
        everywhere = set(range(self.p))
        owners = {i: {d for d in readers[i] if d != -1} for i in range(len(j.invars))}
        needed = rep_needed(j, rep_ops, users, once_readers, outs_at, self.ties, owners, untied=everywhere)
        for i, v in enumerate(j.invars):
            if self.owner[i] != -1 or i in float_read or not owners[i] or owners[i] == everywhere:
                continue
            self.owner[i] = min(owners[i]) if len(owners[i]) == 1 else tuple(sorted(owners[i]))
        for n, s_ in enumerate(spec):
            t = self.ties.get(n)
            if s_[0] == "rep" and t is not None and self.owner[t] not in (-1, None, "batch"):
                spec[n] = ("shared", self.ranks_of(t))
        self._plan_share_targets(needed, users)

    def _plan_share_targets(self, needed, users):
        """Where each stage value that a REP op reads must go (``self.share_targets``: var
        -> the ranks other than its home that need it, or absent where every rank does).
        A tied weight's gradient on stage 0 is needed only where the REP ops summing it
        with stage p-1's are (the owners, ``needed``): it goes to rank p-1 alone by a
        ``ppermute``, not to every rank by a ``psum`` over the pipeline axis, as Paddle's
        SharedLayerDesc sums a shared layer's gradients between its owners only."""
        everywhere = set(range(self.p))
        for q, vs in self.bcast_at.items():
            for v in vs:
                want = set()
                for e in users.get(v, []):
                    want |= needed.get(e, everywhere)
                if want != everywhere:
                    home = self.rank_of(self.var_home[v])
                    self.share_targets[v] = tuple(sorted(want - {home}))

    def _share(self, v, b):
        """Stage value ``v`` (``b``: its value on its home rank, zeros elsewhere) on the
        ranks that need it: a ``ppermute`` from its home to each of them when those are
        known (``share_targets``), else a ``psum`` over the pipeline axis (every rank
        needs it: a global norm). Off its home ``b`` is zeros, so ``b + received`` is
        the value exactly where it is needed."""
        targets = self.share_targets.get(v)
        if targets is None:
            return lax.psum(b, self.axis)
        home = self.rank_of(self.var_home[v])
        out = b
        for t in targets:
            out = out + lax.ppermute(b, self.axis, [(home, t)])
        return out

    def ranks_of(self, i) -> tuple:
        """The pipeline ranks that store input ``i`` (one owner, or a tied weight's owners)."""
        o = self.owner[i]
        return (o,) if isinstance(o, int) and o >= 0 else o if isinstance(o, tuple) else ()

    def _shared_value(self, v, state_row, d):
        """Input ``v`` (stored on some ranks' rows) on every rank: zeros where not stored."""
        owners = self.ranks_of(self.invar_index[v])

        def at(q):
            def read(row):
                if q not in owners:
                    return jnp.zeros(v.aval.shape, v.aval.dtype)
                o = self.state_pack[q].offset[v]
                return _from_f32(lax.slice_in_dim(row, o, o + _size(v)), v.aval.shape, v.aval.dtype)
            return read
        return lax.switch(d, [at(q) for q in range(self.p)], state_row)

    def rank_of(self, k):
        return k % self.p

    def _plan_ticks(self):
        sim, p = self.sim, self.p
        T = int(sim.makespan)
        self.T = T
        self.branch_keys = [None] + [(kind, k) for k in range(self.S) for kind in self.kinds]
        bid = {key: i for i, key in enumerate(self.branch_keys)}
        act = np.zeros((T, p), np.int32)
        mb = np.zeros((T, p), np.int32)
        when = {}   # (d, c, i) -> list of ticks of actions on it
        arrive = {}
        for (t, d), a in sim.tick_table.items():
            k = self.schedule.model_stage(d, a.chunk)
            act[t, d] = bid[(a.kind, k)]
            mb[t, d] = a.microbatch
            when.setdefault((d, a.chunk, a.microbatch), []).append(t)
            if a.kind == F_ and k + 1 < self.S:
                d2, c2 = self.schedule.placement(k + 1)
                arrive[(d2, c2, a.microbatch)] = t
        # slots: intervals [arrival or first action, last action]
        slot_of, nslots = {}, 1
        for d in range(p):
            iv = []
            for (dd, c, i), ts in when.items():
                if dd != d:
                    continue
                start = min(ts + ([arrive[(d, c, i)]] if (d, c, i) in arrive else []))
                iv.append((start, max(ts), c, i))
            iv.sort()
            free_at = []   # per slot: last tick used
            for start, end, c, i in iv:
                for s, last in enumerate(free_at):
                    if last <= start:
                        free_at[s] = end
                        slot_of[(d, c, i)] = s
                        break
                else:
                    slot_of[(d, c, i)] = len(free_at)
                    free_at.append(end)
            nslots = max(nslots, len(free_at))
        self.nslots = nslots
        slot = np.zeros((T, p), np.int32)
        recv_f = -np.ones((T, p), np.int32)
        recv_b = -np.ones((T, p), np.int32)
        for (t, d), a in sim.tick_table.items():
            slot[t, d] = slot_of[(d, a.chunk, a.microbatch)]
            k = self.schedule.model_stage(d, a.chunk)
            if a.kind == F_ and k + 1 < self.S:
                d2, c2 = self.schedule.placement(k + 1)
                recv_f[t, d2] = slot_of[(d2, c2, a.microbatch)]
            if a.kind in (B_, I_) and k > 0:
                d2, c2 = self.schedule.placement(k - 1)
                recv_b[t, d2] = slot_of[(d2, c2, a.microbatch)]
        # actions that add partial sums run in a cond of their own (with the accumulator);
        # the others (and bubbles) never touch it: two switches, each over its own actions
        has_acc = [bool(key is not None and self.progs[key]["accs"]) for key in self.branch_keys]
        self.acc_keys = [i for i, h in enumerate(has_acc) if h]
        self.plain_keys = [i for i, h in enumerate(has_acc) if not h]      # 0 (the no-op) first
        remap = np.zeros(len(self.branch_keys), np.int32)
        for n, i in enumerate(self.acc_keys):
            remap[i] = n
        for n, i in enumerate(self.plain_keys):
            remap[i] = n
        # per tick, whether any rank receives (an exchange no rank reads is skipped)
        any_f = np.repeat((recv_f >= 0).any(axis=1, keepdims=True), p, axis=1).astype(np.int32)
        any_b = np.repeat((recv_b >= 0).any(axis=1, keepdims=True), p, axis=1).astype(np.int32)
        self.tables = dict(act=remap[act], acc=np.asarray(has_acc, np.int32)[act], mb=mb, slot=slot,
                           recv_f=recv_f, recv_b=recv_b, any_f=any_f, any_b=any_b)

    def _packs_per_rank(self, field: str) -> tuple[dict, list]:
        """Per model stage, (its offset on its rank, a Packing of the ``field`` values of its
        programs); and the packed size per rank."""
        packs, sizes = {}, [0] * self.p
        for k in range(self.S):
            d = self.rank_of(k)
            pk = Packing([o for kind in self.kinds for o in self.progs[(kind, k)][field]])
            packs[k] = (sizes[d], pk)
            sizes[d] += pk.size
        return packs, sizes

    def _plan_state(self):
        j, p = self.j, self.p
        self.A = max([1] + [Packing(self.fwd_out[k]).size for k in self.fwd_out])
        self.G = max([1] + [Packing(self.bwd_out[k]).size for k in self.bwd_out])
        self.R = max([1] + [self.resid[k].size for k in range(self.S)])
        # accumulators per rank, at offsets per model stage
        self.acc_pack, sizes = self._packs_per_rank("accs")
        self.ACCK = max([1] + [pk.size for _, pk in self.acc_pack.values()])
        self.ACC = max([1] + sizes + [base + self.ACCK for base, _ in self.acc_pack.values()])
        # per-micro-batch outputs
        self.out_pack, osz = self._packs_per_rank("outs_b")
        self.O = max([1] + osz)
        # packed state per rank
        self.state_pack = [Packing([v for i, v in enumerate(j.invars) if d in self.ranks_of(i)]) for d in range(p)]
        self.state_size = max([1] + [pk.size for pk in self.state_pack])
        self._plan_hoist()

    def _plan_hoist(self):
        """State the tick loop reads, unpacked once before the loop instead of at every
        action: sliced out of the packed row inside a branch, each weight is copied
        whole every time its stage runs (as many bytes as a micro-batch's matmul reads).
        Values leave the loop's switch only in one type for every rank, so ranks pair
        their values by shape and dtype: the n-th value of a signature on every rank
        shares hoisted position n, for as many as the rank with the fewest has (stages
        of equal layers hoist everything; an embedding only rank 0 holds stays sliced).
        ``self.hoist[d]``: var -> position; ``self.hoist_sig``: per position, its aval."""
        j, p = self.j, self.p
        per_rank = []
        for d in range(p):
            seen = []
            for k in range(self.S):
                if self.rank_of(k) != d:
                    continue
                for kind in self.kinds:
                    for v in self.progs[(kind, k)]["reads"]:
                        i = self.invar_index.get(v)
                        if i is not None and d in self.ranks_of(i) and v not in seen:
                            seen.append(v)
            per_rank.append(seen)
        sig = lambda v: (tuple(v.aval.shape), np.dtype(v.aval.dtype).name)
        count = {}
        for seen in per_rank:
            for g in {sig(v) for v in seen}:
                count[g] = min(count.get(g, len(j.invars)), sum(sig(v) == g for v in seen))
        for g in list(count):
            if any(not any(sig(v) == g for v in seen) for seen in per_rank):
                count[g] = 0
        order = sorted((g for g in count if count[g]), key=str)
        base, pos = {}, 0
        for g in order:
            base[g], pos = pos, pos + count[g]
        self.hoist_sig = [None] * pos
        self.hoist = []
        for seen in per_rank:
            used, slot = {}, {}
            for v in seen:
                g = sig(v)
                n = used.get(g, 0)
                if n < count.get(g, 0):
                    slot[v] = base[g] + n
                    self.hoist_sig[base[g] + n] = v.aval
                    used[g] = n + 1
            self.hoist.append(slot)

    def unpack_hoisted(self, state_row, d):
        """Rank ``d``'s hoisted state, in hoist position order (see ``_plan_hoist``)."""
        pk, out = self.state_pack[d], [None] * len(self.hoist_sig)
        for v, n in self.hoist[d].items():
            o = pk.offset[v]
            out[n] = _from_f32(lax.slice_in_dim(state_row, o, o + _size(v)), v.aval.shape, v.aval.dtype)
        return tuple(out)

    def _plan_outputs(self, spec):
        """``spec`` per outvar: ("literal", val) / ("input", idx) / ("float",) / ("bcast", k) /
        ("packed", k) / ("batched", k)."""
        self.out_spec = spec
        p = self.p
        bc = [v for v, s in zip(self.j.outvars, spec) if s[0] == "bcast"]
        self.bcast_vars = list(dict.fromkeys(bc))
        self.bcast_stage = {v: s[1] for v, s in zip(self.j.outvars, spec) if s[0] == "bcast"}
        self.out_state_pack = [Packing([v for v, s in zip(self.j.outvars, spec)
                                        if (s[0] == "packed" and self.rank_of(s[1]) == d)
                                        or (s[0] == "shared" and d in s[1])]) for d in range(p)]
        self.out_state_size = max([1] + [pk.size for pk in self.out_state_pack])

    # -- evaluation
    def _run(self, idxs, env):
        j, lo = self.j, self.an.literal_override
        for i in idxs:
            eqn = j.eqns[i]
            ins = [_literal(lo.get((i, q), a.val)) if isinstance(a, jcore.Literal) else env[a]
                   for q, a in enumerate(eqn.invars)]
            params = eqn.primitive.get_bind_params(eqn.params)
            outs = eqn.primitive.bind(*ins, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o

    def _base_env(self, reads, state_row, d, rep, batch_mb, hoisted=None):
        env = {}
        for cv, val in zip(self.j.constvars, self.consts):
            env[cv] = val
        sp_ = self.state_pack[d] if d >= 0 else Packing([])
        for v in reads:
            if v in env:
                continue
            if v in self.invar_index:
                i = self.invar_index[v]
                if self.batch_mask[i]:
                    env[v] = batch_mb[i]
                elif hoisted is not None and v in self.hoist[d]:
                    env[v] = hoisted[self.hoist[d][v]]
                elif v in sp_.offset:
                    o = sp_.offset[v]
                    env[v] = _from_f32(lax.slice_in_dim(state_row, o, o + _size(v)), v.aval.shape, v.aval.dtype)
                else:
                    env[v] = rep[i]
        return env

    def _branch(self, key):
        kind, k = key
        d = self.rank_of(k)
        prog = self.progs[key]

        def run(ops):
            (act_row, resid_row, ct_row, out_row), mbi, state_row, rep, batch, hoisted = ops
            batch_mb = {i: lax.dynamic_index_in_dim(x, mbi, 0, keepdims=False) for i, x in batch.items()}
            env = self._base_env(prog["reads"], state_row, d, rep, batch_mb, hoisted)
            if k > 0:
                Packing(self.fwd_in[k]).unpack(act_row, env)
            if kind != F_:
                self.resid[k].unpack(resid_row, env)
                if k < self.S - 1 and k in self.bwd_in:
                    Packing(self.bwd_in[k]).unpack(ct_row, env)
            self._run(prog["idxs"], env)
            send_f = jnp.zeros((self.A,), jnp.float32)
            send_b = jnp.zeros((self.G,), jnp.float32)
            if kind == F_:
                if k < self.S - 1:
                    send_f = Packing(self.fwd_out[k]).pack(env, self.A)
                if self.resid[k].size:
                    resid_row = self.resid[k].pack(env, self.R)
            elif prog["sends"]:
                send_b = Packing(prog["sends"]).pack(env, self.G)
            # this action's partial sums, at their offsets in the stage's accumulator piece
            # (returned and added outside the switch: updated in place inside a branch, the
            # accumulator is copied whole on every action, docs/results/pipeline.md)
            base, pk = self.acc_pack[k]
            piece = _placed([(pk.offset[v], _to_f32(env[v])) for v in pk.vars if v in prog["accs"]], self.ACCK)
            obase, opk = self.out_pack[k]
            for v in prog["outs_b"]:
                out_row = lax.dynamic_update_slice_in_dim(out_row, _to_f32(env[v]), obase + opk.offset[v], 0)
            return (resid_row, out_row), (piece, jnp.int32(base)), send_f, send_b
        return run

    def _once(self, d, q, rep_keys):
        last = q == self.nphases - 1

        def run(ops):
            acc, state_row, rep, rep_vals = ops
            env_rep = dict(zip(rep_keys, rep_vals))
            ks = [k for k in range(self.S) if self.rank_of(k) == d]
            idxs = sorted(set(i for k in ks for i in self.once[k]["idxs"] if self.op_phase.get(i, 0) <= q))
            reads = self._reads(idxs)
            outs = self.out_state_pack[d]
            needed = list(reads) + [v for v in outs.vars] + list(self.bcast_vars)
            env = self._base_env(needed, state_row, d, rep, {})
            env.update(env_rep)
            for k in ks:
                base, pk = self.acc_pack[k]
                for v in pk.vars:
                    env[v] = _from_f32(lax.slice_in_dim(acc, base + pk.offset[v], base + pk.offset[v] + _size(v)),
                                       v.aval.shape, v.aval.dtype)
            self._run(idxs, env)
            mine = lambda v, k: env[v] if self.rank_of(k) == d else jnp.zeros(v.aval.shape, v.aval.dtype)
            bc = [mine(v, self.var_home[v]) for v in self.bcast_at.get(q, [])]
            if not last:
                return bc, jnp.zeros((self.out_state_size,), jnp.float32), [
                    jnp.zeros(v.aval.shape, v.aval.dtype) for v in self.bcast_vars]
            packed = outs.pack(env, self.out_state_size)
            return bc, packed, [mine(v, self.bcast_stage[v]) for v in self.bcast_vars]
        return run

    def _run_rep(self, q, env_rep, rep, state_row=None, d=None):
        """The REP once ops of phase ``q`` (and the floats they need), on every rank."""
        idxs = [i for i in self.rep_idxs if self.op_phase.get(i, 0) == q or (
            self.an.roles[i] == FLOAT and not all(o in env_rep for o in self.j.eqns[i].outvars))]
        if not idxs:
            return
        reads = self._reads(idxs)
        stored = [v for v in reads if v in self.invar_index and self.ranks_of(self.invar_index[v])]
        env = self._base_env([v for v in reads if v not in stored], None, -1, rep, {})
        env.update({v: self._shared_value(v, state_row, d) for v in stored})
        env.update(env_rep)
        self._run(idxs, env)
        for i in idxs:
            for o in self.j.eqns[i].outvars:
                env_rep[o] = env[o]

    def build(self, n_sources, src_desc):
        """The jitted step: ``(sources, rep, batch) -> (packed_out, bcasts, out_buf)``.
        ``src_desc[d]``: per state var of rank d, (source index, offset) of its value."""
        p, ax, m = self.p, self.axis, self.m
        tables = {k: jnp.asarray(v) for k, v in self.tables.items()}
        branches = [lambda ops: ((ops[0][1], ops[0][3]), (jnp.zeros((self.ACCK,), jnp.float32), jnp.int32(0)),
                                 jnp.zeros((self.A,), jnp.float32), jnp.zeros((self.G,), jnp.float32))]
        branches += [self._branch(key) for key in self.branch_keys[1:]]
        acc_branches = [branches[i] for i in self.acc_keys]
        plain_branches = [branches[i] for i in self.plain_keys]
        rep_out_vars = [v for v, s_ in zip(self.j.outvars, self.out_spec) if s_[0] == "rep"]
        fwd_perm = [(d, d + 1) for d in range(p - 1)] + ([(p - 1, 0)] if self.v > 1 else [])
        bwd_perm = [(d + 1, d) for d in range(p - 1)] + ([(0, p - 1)] if self.v > 1 else [])
        state_pack = self.state_pack

        def gather_state(sources, d):
            # this rank's packed state row from the source rows (in place when the layout matches)
            pk = state_pack[d]
            parts = []
            for v in pk.vars:
                si, off = src_desc[d][v]
                parts.append((pk.offset[v], lax.slice_in_dim(_row(sources[si]), off, off + _size(v))))
            return _placed(parts, self.state_size)

        def body(sources, rep, batch):
            d = lax.axis_index(ax)
            if n_sources == 1 and all(src_desc[q][v] == (0, state_pack[q].offset[v])
                                      for q in range(p) for v in state_pack[q].vars):
                state_row = _row(sources[0])
                if state_row.shape[0] < self.state_size:
                    state_row = jnp.pad(state_row, (0, self.state_size - state_row.shape[0]))
            else:
                state_row = lax.switch(d, [lambda s, q=q: gather_state(s, q) for q in range(p)], sources)
            # the state the loop reads, unpacked once (_plan_hoist)
            hoisted = (lax.switch(d, [lambda s, q=q: self.unpack_hoisted(s, q) for q in range(p)], state_row)
                       if self.hoist_sig else ())
            carry = (jnp.zeros((self.nslots, self.A), jnp.float32), jnp.zeros((self.nslots, self.R), jnp.float32),
                     jnp.zeros((self.nslots, self.G), jnp.float32), jnp.zeros((self.ACC,), jnp.float32),
                     jnp.zeros((m, self.O), jnp.float32))

            def tick(carry, row):
                a, has_acc, mbi, slot, rf, rb, any_f, any_b = (row[n][d] for n in (
                    "act", "acc", "mb", "slot", "recv_f", "recv_b", "any_f", "any_b"))
                act_in, resid, ct_in, acc, out_buf = carry
                rows = (act_in[slot], resid[slot], ct_in[slot], out_buf[mbi])
                ops = (rows, mbi, state_row, rep, batch, hoisted)

                def accumulating(acc):
                    (resid_row, out_row), (piece, base), send_f, send_b = lax.switch(a, acc_branches, ops)
                    acc = lax.dynamic_update_slice_in_dim(
                        acc, lax.dynamic_slice_in_dim(acc, base, self.ACCK) + piece, base, 0)
                    return acc, resid_row, out_row, send_f, send_b

                def plain(acc):
                    (resid_row, out_row), _, send_f, send_b = lax.switch(a, plain_branches, ops)
                    return acc, resid_row, out_row, send_f, send_b

                if acc_branches:
                    acc, resid_row, out_row, send_f, send_b = lax.cond(has_acc > 0, accumulating, plain, acc)
                else:
                    acc, resid_row, out_row, send_f, send_b = plain(acc)
                # only the rows and the accumulator piece an action touches are written back
                resid = resid.at[slot].set(resid_row)
                out_buf = out_buf.at[mbi].set(out_row)
                if p > 1:
                    # an exchange runs only on the ticks where some rank receives (the same
                    # static flag on every rank, so every rank takes the same branch)
                    got_f = lax.cond(any_f > 0, lambda x: lax.ppermute(x, ax, fwd_perm), lambda x: x, send_f)
                    got_b = lax.cond(any_b > 0, lambda x: lax.ppermute(x, ax, bwd_perm), lambda x: x, send_b)
                    sf = jnp.maximum(rf, 0)
                    act_in = act_in.at[sf].set(jnp.where(rf >= 0, got_f, act_in[sf]))
                    sb = jnp.maximum(rb, 0)
                    ct_in = ct_in.at[sb].set(jnp.where(rb >= 0, got_b, ct_in[sb]))
                return (act_in, resid, ct_in, acc, out_buf), None

            carry, _ = lax.scan(tick, carry, tables)
            acc, out_buf = carry[3], carry[4]
            if self.dp_axis:
                # data parallel inside each stage: the partial sums of every dp device's rows
                acc = lax.psum(acc, self.dp_axis)
                out_buf = lax.all_gather(out_buf, self.dp_axis)
            else:
                out_buf = out_buf[None]
            env_rep = {}
            for q in range(self.nphases):
                self._run_rep(q, env_rep, rep, state_row, d)
                keys = list(env_rep)
                bc, packed, bvals = lax.switch(d, [self._once(r, q, keys) for r in range(p)],
                                               (acc, state_row, rep, [env_rep[k] for k in keys]))
                for v, b in zip(self.bcast_at.get(q, []), bc):
                    env_rep[v] = self._share(v, b)
            bvals = [lax.psum(b, ax) for b in bvals]
            out_buf = lax.psum(out_buf, ax)
            lead = (1, 1) if self.sub else (1,)
            return packed.reshape(lead + packed.shape), bvals, out_buf, [env_rep[v] for v in rep_out_vars]

        state_spec, rep_spec, batch_spec, rep_out_spec = self._specs(rep_out_vars)
        # per-example outputs: beside a sub-mesh each device's blocks, stacked over it
        out_spec = P(tuple(self.sub.axes)) if self.sub else P()
        smap = jax.shard_map(body, mesh=self.mesh,
                             in_specs=([state_spec] * n_sources, rep_spec, batch_spec),
                             out_specs=(state_spec, P(), out_spec, rep_out_spec), check_vma=False)
        return jax.jit(smap)

    def rep_inputs(self) -> list:
        """The invars every rank reads (replicated over the pipeline axis)."""
        return [i for i, d in enumerate(self.owner) if d == -1]

    def batch_inputs(self) -> list:
        return [i for i, d in enumerate(self.owner) if d == "batch"]

    def _specs(self, rep_out_vars):
        """in/out specs of the step: the packed state (split over the pipeline axis, and the
        sub-mesh), the replicated inputs, the batch (``(m, rows, ...)``) and the replicated
        outputs; without a sub-mesh the old ``dp``-only layout."""
        ax, sub = self.axis, self.sub
        if sub is None:
            return P(ax), P(), P(None, self.dp_axis) if self.dp_axis else P(), P()
        pos = {v: n for n, v in enumerate(self.j.outvars)}
        return (P(ax, tuple(sub.axes)), {i: sub.spec(sub.in_dims[i]) for i in self.rep_inputs()},
                {i: P(None, *sub.spec(sub.in_dims[i])) for i in self.batch_inputs()},
                [sub.spec(sub.out_dims[pos[v]]) for v in rep_out_vars])

    def float_fn(self):
        """The replicated outputs (computed from step inputs only), on the global trace."""
        gj = self.an.global_jaxpr
        idxs, outs = self.float_idxs, self.float_outs
        pos = {v: n for n, v in enumerate(self.j.outvars)}

        def run(args):
            env = dict(zip(gj.jaxpr.constvars, gj.consts))
            env.update({gj.jaxpr.invars[i]: a for i, a in args.items()})
            for i in idxs:
                eqn = gj.jaxpr.eqns[i]
                ins = [a.val if isinstance(a, jcore.Literal) else env[a] for a in eqn.invars]
                params = eqn.primitive.get_bind_params(eqn.params)
                o = eqn.primitive.bind(*ins, **params)
                for var, val in zip(eqn.outvars, o if eqn.primitive.multiple_results else [o]):
                    env[var] = val
            return [env[gj.jaxpr.outvars[pos[v]]] for v in outs]
        return jax.jit(run)


def noop_branch_opcodes(hlo_text: str) -> list:
    """The opcodes of the first branch (the bubble tick's no-op) of the tick loop's
    ``conditional`` in compiled HLO text, with the computations its fusions call. A
    bubble computes nothing when these only move buffers (tuple, copy, broadcast of a
    constant...)."""
    import re
    cond = re.search(r"conditional\(.*branch_computations=\{%([\w.\-]+),", hlo_text)
    if not cond:
        return []
    body = re.search(r"\n%" + re.escape(cond.group(1)) + r" .*?\n}\n", hlo_text, re.S).group(0)
    ops = re.findall(r"= \S+ (\w[\w-]*)\(", body)
    return ops + [f"fusion:{c}" for c in re.findall(r"calls=%([\w.\-]+)", body)]


BUFFER_MOVES = {"parameter", "constant", "get-tuple-element", "tuple", "copy", "fusion", "broadcast", "bitcast"}


def bubble_computes_nothing(hlo_text: str) -> bool:
    ops = noop_branch_opcodes(hlo_text)
    return bool(ops) and all(o in BUFFER_MOVES or (o.startswith("fusion:") and "broadcast" in o) for o in ops)


def zero_filled_concatenates(hlo_text: str) -> list:
    """The computations of compiled HLO text in which a ``concatenate`` takes a
    ``broadcast`` of more than ``SMALL_GAP`` elements among its operands: the fusion
    ``_placed`` avoids (XLA CPU runs it far slower than the fill it stands for)."""
    import re
    found = []
    for name, body in re.findall(r"\n%([\w.\-]+) [^\n]*\{\n(.*?)\n}\n", hlo_text, re.S):
        bcast = {n for n, dims in re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]\S* broadcast\(", body)
                 if int(np.prod([int(x) for x in dims.split(",") if x], dtype=np.int64)) > SMALL_GAP}
        for ops in re.findall(r"= \S+ concatenate\(([^)]*)\)", body):
            if any(o.strip().lstrip("%") in bcast for o in ops.split(",")):
                found.append(name)
                break
    return found


def replica_groups(text: str) -> list:
    """The device groups of an HLO ``replica_groups=`` value: explicit ``{{0,1},{2,3}}``
    or the iota form ``[G,S]<=[dims]T(perm)``."""
    import re
    if text.startswith("{"):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", text)]
    m = re.match(r"\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(g, s).tolist()


def collectives_across_pipeline(hlo_text: str, inner: int) -> list:
    """The collectives of compiled HLO text that cross pipeline ranks, on a mesh whose
    pipeline axis comes first and the other axes hold ``inner`` devices (device ``n`` is
    pipeline rank ``n // inner``, sub-mesh rank ``n % inner``): ``(kind, elements, pairs
    or groups)`` with each device as ``(pipeline rank, sub-mesh rank)``; a
    collective-permute's ``(source, target)`` pairs, another collective's groups."""
    import re
    rank = lambda dev: divmod(dev, inner)   # noqa: E731
    found = []
    for line in hlo_text.splitlines():
        # the result type: one array, or a tuple of them where XLA combined collectives
        op = re.search(r"= (\([^=]*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                       r"(-start)?\(", line)
        if not op:
            continue
        shape = re.findall(r"\[([0-9,]*)\]", op.group(1))
        elems = max(int(np.prod([int(x) for x in s.split(",") if x])) for s in shape) if shape else 1
        if op.group(2) == "collective-permute":
            text = re.search(r"source_target_pairs=\{([{}0-9,]*)\}", line).group(1)
            pairs = [(rank(int(a)), rank(int(b))) for a, b in re.findall(r"\{(\d+),(\d+)\}", text)]
            if any(a[0] != b[0] for a, b in pairs):
                found.append((op.group(2), elems, pairs))
        else:
            groups = replica_groups(re.search(r"replica_groups=(\S+?)(?:, [a-z_]+=|$)", line).group(1))
            if any(len({rank(d)[0] for d in g}) > 1 for g in groups):
                found.append((op.group(2), elems, [[rank(d) for d in g] for g in groups]))
    return found
