"""Lower an analysed pipeline to one program per stage action (MPMD), driven from Python.

``sp.Pipeline(..., lowering="mpmd")``. The analysis and the plan are the SPMD
lowering's (``runtime/pipeline_lower.py`` ``PipelineProgram``: which equations each
(action kind, model stage) runs, what crosses each cut, what a backward keeps of its
forward, the once ops and their phases, who owns each input); only the execution differs:

- every (action kind, model stage) is its own ``jax.jit`` program over exactly the values
  it reads, on its rank's device. Nothing is packed into flat rows and nothing is padded
  to the largest stage: a rank holds its own stage's parameters, at their own shapes;
- a Python driver walks the schedule's tick table (the same table the simulator and the
  SPMD lowering use) in tick order and dispatches each action without waiting for it
  (jax dispatch is asynchronous); what a forward sends (a backward's input cotangents) is
  moved to the next (previous) stage's device with ``jax.device_put``, only between
  neighbouring ranks (and the interleaved wrap-around). So no rank waits at a tick for
  the others: each device runs its actions as soon as their inputs are there;
- a backward's partial sums (weight gradients) are added into its stage's accumulator
  inside the same program, the accumulator donated (updated in place);
- after the ticks, the once ops (the optimizer) run per rank in the plan's phases, on that
  rank's accumulators and parameters. Ops that combine stages (a tied weight's gradient
  sum, a global norm) run on the ranks that need their results, fed by transfers from
  the ranks that computed their inputs (a tied weight: between its two owners only).

State: the step's new parameters and optimizer state come back as ordinary jax arrays,
each committed to its stage's device; passed back to the step they are read in place.
A value several ranks hold (a tied weight, Adam's step count) comes back as the first
rank's array, and the driver remembers the other ranks' copies for the next call, so it
is not sent again.

Only the pipeline axis: data or tensor parallel axes beside it are refused
(``compiler/stages.py`` ``check_pipeline``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import SingleDeviceSharding

from ..ir.errors import ShardingError

F_, B_, I_, W_ = "forward", "backward", "backward_input", "backward_weight"
REP = -1


def _lit(a) -> bool:
    return isinstance(a, jcore.Literal)


def _unique(xs) -> list:
    return list(dict.fromkeys(xs))


class MpmdProgram:
    """The MPMD step for one input signature, built on a planned ``PipelineProgram``."""

    def __init__(self, prog, devices):
        if prog.sub is not None or prog.dp_axis:
            raise ShardingError('Pipeline(lowering="mpmd") runs stages over the pipeline axis alone; for data or '
                                'tensor parallel axes beside it use lowering="spmd" (the default)')
        self.prog, self.p, self.S, self.m = prog, prog.p, prog.S, prog.m
        self.devices = list(devices)            # per pipeline rank
        if len(self.devices) != self.p:
            raise ShardingError(f'Pipeline(lowering="mpmd"): {len(self.devices)} devices for {self.p} ranks')
        self.j = prog.j
        self.consts = dict(zip(self.j.constvars, prog.consts))
        self.transfers = []                     # (from rank, to rank, what) of the last call's tick loop
        self.once_transfers = []                # the same for the once phases
        self._copies = []                       # (array returned, {rank: its copy there}) of the last call
        self._plan_actions()
        self._plan_once()

    # ---------------------------------------------------------------- planning
    def _plan_actions(self):
        """Per (kind, model stage): the program's inputs (in order), where each comes from,
        and its outputs: what it sends, keeps for its backward, accumulates and outputs."""
        prog, j = self.prog, self.j
        self.fwd_in = {k: _unique(prog.fwd_in.get(k, [])) for k in range(self.S)}
        self.fwd_out = {k: _unique(prog.fwd_out.get(k, [])) for k in range(self.S)}
        self.bwd_in = {k: _unique(prog.bwd_in.get(k, [])) for k in range(self.S)}
        self.bwd_out = {k: _unique(prog.bwd_out.get(k, [])) for k in range(self.S)}
        self.actions = {}
        for (kind, k), pr in prog.progs.items():
            reads = [v for v in pr["reads"] if v not in self.consts]
            sends = [a for a in pr["sends"] if not _lit(a)]
            keep = list(prog.resid[k].vars) if kind == F_ else []
            accs = _unique(pr["accs"])
            outs_b = _unique(pr["outs_b"])
            self.actions[(kind, k)] = dict(idxs=pr["idxs"], reads=reads, sends=sends, keep=keep, accs=accs,
                                           outs_b=outs_b, fns={})

    def _action_fn(self, kind, k, first: bool):
        """The jitted action: ``(acc, *reads) -> (acc + partial sums, sends, kept, outputs)``
        with the accumulator donated; ``first`` (the stage's first accumulating action):
        ``(*reads) -> (partial sums, ...)``."""
        a = self.actions[(kind, k)]
        if first in a["fns"]:
            return a["fns"][first]
        prog, reads = self.prog, a["reads"]
        dev = self.devices[prog.rank_of(k)]

        def run(acc, *vals):
            env = dict(self.consts)
            env.update(zip(reads, vals))
            prog._run(a["idxs"], env)
            part = [env[v] for v in a["accs"]]
            summed = part if acc is None else [x + y for x, y in zip(acc, part)]
            return (summed, [env[v] for v in a["sends"]], [env[v] for v in a["keep"]],
                    [env[v] for v in a["outs_b"]])
        out = SingleDeviceSharding(dev)
        if first or not a["accs"]:
            fn = jax.jit(lambda *vals: run(None, *vals), out_shardings=out)
        else:
            fn = jax.jit(run, out_shardings=out, donate_argnums=0)
        a["fns"][first] = fn
        return fn

    def _plan_once(self):
        """The once ops per (rank, phase): a rank's stage once ops, and the ops that
        combine stages (REP) on every rank that needs their results."""
        prog, j = self.prog, self.j
        home = {}                       # var -> rank that computes it (stage values)
        for k in range(self.S):
            for kind in prog.kinds:
                for v in self.actions[(kind, k)]["accs"]:
                    home[v] = prog.rank_of(k)
        rep_ops = list(prog.rep_idxs)
        # per rank, its stages' once ops (an op computed from inputs alone may serve several ranks)
        stage_ops = [set() for _ in range(self.p)]
        for k in range(self.S):
            stage_ops[prog.rank_of(k)] |= set(prog.once[k]["idxs"])
        readers = {}                    # var -> ranks whose stage once ops read it
        for d, idxs in enumerate(stage_ops):
            for i in idxs:
                for a in j.eqns[i].invars:
                    if not _lit(a):
                        readers.setdefault(a, set()).add(d)
        users = {}
        for e in rep_ops:
            for a in j.eqns[e].invars:
                if not _lit(a):
                    users.setdefault(a, []).append(e)
        invar_index = prog.invar_index
        outs_at = {}
        for n, v in enumerate(j.outvars):
            if not _lit(v):
                outs_at.setdefault(v, []).append(n)
        # the ranks whose actions or stage once ops read each input
        in_readers = {}
        for (kind, k), a in self.actions.items():
            for v in a["reads"]:
                if v in invar_index:
                    in_readers.setdefault(v, set()).add(prog.rank_of(k))
        for a, ds in readers.items():
            if a in invar_index:
                in_readers.setdefault(a, set()).update(ds)
        ties = prog.ties or {}
        # where a REP op runs: every rank that needs one of its results (a fixed point over
        # the REP ops reading them, and the next step's readers of an input it replaces)
        run_on = {e: set() for e in rep_ops}
        changed = True
        while changed:
            changed = False
            for e in reversed(rep_ops):
                want = set()
                for o in j.eqns[e].outvars:
                    want |= readers.get(o, set())
                    for u in users.get(o, []):
                        want |= run_on[u]
                    for n in outs_at.get(o, []):
                        t = ties.get(n)
                        if t is not None:
                            want |= in_readers.get(j.invars[t], set())
                            want |= {d for u in users.get(j.invars[t], []) for d in run_on[u]}
                if not want <= run_on[e]:
                    run_on[e] |= want
                    changed = True
        for e in rep_ops:
            if not run_on[e]:
                # nobody else needs it (a returned metric): the lowest rank among its inputs' homes
                ins = [home[a] for a in j.eqns[e].invars if not _lit(a) and a in home]
                run_on[e] = {min(ins) if ins else 0}
            for o in j.eqns[e].outvars:
                home.setdefault(o, min(run_on[e]))
        self.rep_run_on = run_on
        # per (rank, phase): its ops in program order
        phases = prog.nphases
        self.segments = []
        for q in range(phases):
            for d in range(self.p):
                idxs = sorted({i for i in stage_ops[d] if prog.op_phase.get(i, 0) == q}
                              | {e for e in rep_ops if d in run_on[e] and prog.op_phase.get(e, 0) == q})
                if idxs:
                    self.segments.append(dict(rank=d, idxs=idxs, reads=[v for v in prog._reads(idxs)
                                                                        if v not in self.consts]))
        read_later = set()
        for s in self.segments:
            read_later |= set(s["reads"])
        outset = {v for v in j.outvars if not _lit(v)}
        for s in self.segments:
            produced = _unique(o for i in s["idxs"] for o in j.eqns[i].outvars)
            s["outs"] = [o for o in produced if o in read_later or o in outset]
            s["fn"] = None
        # every input's storage: the ranks whose programs read it
        self.input_ranks = {}
        for v, ds in in_readers.items():
            self.input_ranks[v] = set(ds)
        for s in self.segments:
            for v in s["reads"]:
                if v in invar_index:
                    self.input_ranks.setdefault(v, set()).add(s["rank"])

    def _segment_fn(self, s):
        if s["fn"] is None:
            prog, reads, idxs, outs = self.prog, s["reads"], s["idxs"], s["outs"]

            def run(*vals):
                env = dict(self.consts)
                env.update(zip(reads, vals))
                prog._run(idxs, env)
                return [env[v] for v in outs]
            s["fn"] = jax.jit(run, out_shardings=SingleDeviceSharding(self.devices[s["rank"]]))
        return s["fn"]

    # ---------------------------------------------------------------- running
    def _put(self, x, d, what, log):
        """``x`` on rank ``d``'s device (a transfer, logged, when it lies on another rank's)."""
        dev = self.devices[d]
        src = _rank_of_array(x, self.devices)
        if src == d:
            return x
        if src is not None:
            log.append((src, d, what))
        return jax.device_put(x, dev)

    def _input_on(self, leaves, i, d, cache, copies):
        """Input ``i`` on rank ``d``: the user's leaf, a copy the last call left there, or a
        transfer (once per call and rank)."""
        key = (i, d)
        if key not in cache:
            x = leaves[i]
            kept = copies.get(id(x))
            if kept is not None and kept[0] is x and d in kept[1]:
                cache[key] = kept[1][d]
            else:
                if not isinstance(x, jax.Array):
                    x = np.asarray(x)
                cache[key] = self._put(x, d, "input", [])
        return cache[key]

    def __call__(self, leaves, batch_mask):
        prog, j, m, p = self.prog, self.j, self.m, self.p
        invar_index = prog.invar_index
        copies = {id(x): (x, c) for x, c in self._copies}
        cache = {}
        # the batch: each micro-batch on the ranks that read it
        micro = {}

        def batch_on(i, mb, d):
            if (i, mb, d) not in micro:
                if (i, d) not in micro:
                    x = leaves[i]
                    x = np.asarray(x) if not isinstance(x, jax.Array) else x
                    rows = x.shape[0] // m
                    whole = jax.device_put(x, self.devices[d])
                    micro[(i, d)] = _split(whole, m, rows)
                micro[(i, mb, d)] = micro[(i, d)][mb]
            return micro[(i, mb, d)]

        log = []
        acts = {}          # (model stage, mb) -> {var: value} received from the previous stage
        cts = {}           # (model stage, mb) -> {var: value} received from the next stage
        kept = {}          # (model stage, mb) -> {var: value} kept by the forward for the backward
        acc = {}           # model stage -> {acc var: accumulated value}
        outs_b = {}        # var -> [value per micro-batch]
        sim = prog.sim
        for t in range(int(sim.makespan)):
            for d in range(p):
                act = sim.tick_table.get((t, d))
                if act is None:
                    continue
                k = prog.schedule.model_stage(d, act.chunk)
                kind, mb = act.kind, act.microbatch
                a = self.actions[(kind, k)]
                env = {}
                env.update(acts.get((k, mb), {}))
                if kind != F_:
                    env.update(kept.get((k, mb), {}))
                    env.update(cts.get((k, mb), {}))
                vals = []
                for v in a["reads"]:
                    if v in env:
                        vals.append(env[v])
                    elif v in invar_index:
                        i = invar_index[v]
                        vals.append(batch_on(i, mb, d) if batch_mask[i] else
                                    self._input_on(leaves, i, d, cache, copies))
                    else:
                        raise ShardingError(f"pipeline (mpmd): {kind} of stage {k} reads {v} ({v.aval}), which no "
                                            "earlier action provides; use lowering=\"spmd\"")
                first = k not in acc or not all(v in acc[k] for v in a["accs"])
                fn = self._action_fn(kind, k, first)
                if a["accs"] and not first:
                    summed, sends, keep, ob = fn([acc[k][v] for v in a["accs"]], *vals)
                else:
                    summed, sends, keep, ob = fn(*vals)
                if a["accs"]:
                    acc.setdefault(k, {}).update(zip(a["accs"], summed))
                if keep:
                    kept[(k, mb)] = dict(zip(a["keep"], keep))
                for v, x in zip(a["outs_b"], ob):
                    outs_b.setdefault(v, [None] * m)[mb] = x
                if kind == F_ and k + 1 < self.S and sends:
                    d2 = prog.rank_of(k + 1)
                    moved = [self._put(x, d2, "activation", log) for x in sends]
                    acts[(k + 1, mb)] = dict(zip(self.fwd_in[k + 1], moved))
                elif kind in (B_, I_) and k > 0 and sends:
                    d2 = prog.rank_of(k - 1)
                    moved = [self._put(x, d2, "cotangent", log) for x in sends]
                    cts[(k - 1, mb)] = dict(zip(self.bwd_in[k - 1], moved))
                # after a (stage, micro-batch)'s last action nothing reads its values again
                if kind in (B_, W_) or not prog.an.training:
                    acts.pop((k, mb), None)
                    kept.pop((k, mb), None)
                    cts.pop((k, mb), None)
        self.transfers = log
        return self._finish(leaves, acc, outs_b, cache, copies)

    def _finish(self, leaves, acc, outs_b, cache, copies):
        """The once phases per rank, then the step's outputs in the user's order."""
        prog, j = self.prog, self.j
        invar_index = prog.invar_index
        envs = [dict() for _ in range(self.p)]      # rank -> {var: value on its device}
        homes = {}                                  # var -> ranks holding it
        for k, vals in acc.items():
            d = prog.rank_of(k)
            for v, x in vals.items():
                envs[d][v] = x
                homes.setdefault(v, []).append(d)
        log = []
        for s in self.segments:
            d = s["rank"]
            vals = []
            for v in s["reads"]:
                if v in envs[d]:
                    vals.append(envs[d][v])
                elif v in invar_index:
                    vals.append(self._input_on(leaves, invar_index[v], d, cache, copies))
                elif v in homes:
                    x = self._put(envs[homes[v][0]][v], d, "once", log)
                    envs[d][v] = x
                    homes[v].append(d)
                    vals.append(x)
                else:
                    raise ShardingError(f"pipeline (mpmd): the once ops on rank {d} read {v} ({v.aval}), which no "
                                        "earlier program computes; use lowering=\"spmd\"")
            for v, x in zip(s["outs"], self._segment_fn(s)(*vals)):
                envs[d][v] = x
                homes.setdefault(v, []).append(d)
        self.once_transfers = log
        outs, new_copies = [], []
        for v, spec in zip(j.outvars, prog.out_spec):
            kind = spec[0]
            if kind == "literal":
                outs.append(jnp.asarray(spec[1]))
            elif kind == "input":
                outs.append(leaves[spec[1]])
            elif kind == "float":
                outs.append(None)                   # filled by the caller (computed from inputs only)
            elif kind == "batched":
                parts = outs_b[v]
                bd = prog.an.bdim[v]
                outs.append(jnp.concatenate(parts, axis=bd) if len(parts) > 1 else parts[0])
            else:
                ranks = homes.get(v)
                if not ranks:
                    raise ShardingError(f"pipeline (mpmd): the step's output {v} ({v.aval}) was not computed; use "
                                        "lowering=\"spmd\"")
                x = envs[ranks[0]][v]
                outs.append(x)
                if len(ranks) > 1:
                    new_copies.append((x, {d: envs[d][v] for d in ranks}))
        self._copies = new_copies
        return outs

    def param_bytes(self, leaves) -> list:
        """Per rank, the bytes of the step's inputs stored there (its parameters and
        optimizer state), at their own shapes."""
        per = [0] * self.p
        for v, ds in self.input_ranks.items():
            i = self.prog.invar_index[v]
            if self.prog.batch_mask[i]:
                continue
            for d in ds:
                per[d] += int(np.prod(v.aval.shape, dtype=np.int64)) * np.dtype(v.aval.dtype).itemsize
        return per


def _split(x, m: int, rows: int):
    return [x[n * rows:(n + 1) * rows] for n in range(m)]


def _rank_of_array(x, devices):
    """The rank whose device holds ``x`` alone, or None (host data, or several devices)."""
    if not isinstance(x, jax.Array):
        return None
    try:
        devs = x.devices()
    except Exception:                               # noqa: BLE001 (a tracer or deleted array)
        return None
    if len(devs) != 1:
        return None
    dev = next(iter(devs))
    return devices.index(dev) if dev in devices else None
