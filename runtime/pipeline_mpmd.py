"""Lower an analysed pipeline to one program per stage action (MPMD), driven from Python.

``sp.Pipeline(..., lowering="mpmd")``. The analysis and the plan are the SPMD
lowering's (``runtime/pipeline_lower.py`` ``PipelineProgram``: which equations each
(action kind, model stage) runs, what crosses each cut, what a backward keeps of its
forward, the once ops and their phases, who owns each input); only the execution differs:

- every (action kind, model stage) is its own ``jax.jit`` program over exactly the values
  it reads, on its rank's device. Nothing is packed into flat rows and nothing is padded
  to the largest stage: a rank holds its own stage's parameters, at their own shapes;
- a Python driver walks the schedule's tick table (the same table the simulator and the
  SPMD lowering use) once, into a list of instructions over registers (``run`` an
  action's program, ``move`` values with ``jax.device_put``); a call executes the list,
  dispatching each action without waiting for it (jax dispatch is asynchronous). What a
  forward sends (a backward's input cotangents) moves to the next (previous) stage's
  device, only between neighbouring ranks (and the interleaved wrap-around). So no rank
  waits at a tick for the others: each device runs its actions as soon as their inputs
  are there, and a bubble dispatches nothing;
- a backward's partial sums (weight gradients) are added into its stage's accumulator
  inside the same program, the accumulator donated (updated in place);
- after the ticks, the once ops (the optimizer) run per rank in the plan's phases, on that
  rank's accumulators and parameters. Ops that combine stages (a tied weight's gradient
  sum, a global norm) run on the ranks that need their results, fed by transfers from
  the ranks that computed their inputs (a tied weight: between its two owners only).

State: the step's new parameters and optimizer state come back as ordinary jax arrays,
each committed to its stage's device; passed back to the step they are read in place.
A value several ranks hold (a tied weight and its optimizer state) comes back as the
first rank's array, and the driver remembers the other ranks' copies for the next call,
so it is not sent again.

Data parallel inside a stage (a ``dp`` axis beside the pipeline's): each action is a
``shard_map`` over its rank's dp group running the per-device program on its rows;
per-device values are stacked on a leading dp dim, and a stage's partial sums are
summed over dp once, before its once ops. Tensor parallel axes and ZeRO-1 (a per-rank
program planned on the axes beside the pipeline's, ``prog.sub``): each action and each
once phase is a ``shard_map`` over the rank's sub-mesh running that program with its
collectives; the step's inputs go in, and its outputs come out, under their planned
layouts, and every other value is each device's own, stacked over the sub-mesh.

Several processes (``shardprop launch``): every process builds the same instruction list
and executes its own part of it (``_localize``): its ranks' programs, ``device_put``
between its ranks, and a transfer both processes run for a value crossing to or from
another process's rank (``runtime/pipeline_mpmd_procs.py``). A stage's state comes back
as a global array on its rank's devices; the loss and other values every caller reads,
replicated on every device of the mesh, as the SPMD lowering returns them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ..ir.errors import ShardingError
from .pipeline_lower import rep_needed
from .pipeline_mpmd_procs import Transfers, empty_like_on, mirrored

F_, B_, I_, W_ = "forward", "backward", "backward_input", "backward_weight"


def tick_actions(prog) -> list:
    """Per tick of ``prog``'s unit-cost tick table, its ``(rank, Action)`` pairs by rank:
    the order in which the driver issues the actions (``MpmdProgram._compile_code``)."""
    table = prog.sim.tick_table
    return [[(d, table[(t, d)]) for d in range(prog.p) if (t, d) in table] for t in range(int(prog.sim.makespan))]


def driver_order(prog) -> list:
    """The instructions the MPMD driver issues for ``prog``, in order, without building
    the programs (what the pipeline's host model, ``pipeline_step.mpmd_host_step``, needs):
    ``("run", rank, Action)`` per action, ``("move", n)`` after each tick in which ``n``
    actions send to a neighbour (one ``jax.device_put`` for the tick's values), then
    ``("once", rank)`` per rank for its once ops (the optimizer: at least one program each)."""
    order, S = [], prog.S
    for tick in tick_actions(prog):
        sends = 0
        for d, act in tick:
            order.append(("run", d, act))
            k = prog.schedule.model_stage(d, act.chunk)
            sends += (act.kind == F_ and k + 1 < S) or (act.kind in (B_, I_) and k > 0)
        if sends:
            order.append(("move", sends))
    return order + [("once", d) for d in range(prog.p)]


def _lit(a) -> bool:
    return isinstance(a, jcore.Literal)


def _unique(xs) -> list:
    return list(dict.fromkeys(xs))


def _stacked_map(run, mesh, kinds, in_specs, out_spec, donate=0):
    """``run`` on every device of ``mesh`` (a ``shard_map``): a ``"stacked"`` argument is
    each device's own value (a leading dim of 1 in its block), the others as ``in_specs``
    lay them; every result comes back stacked. The first ``donate`` arguments donated."""
    def per_device(*vals):
        vals = [x[0] if kd == "stacked" else x for x, kd in zip(vals, kinds)]
        return [x[None] for x in run(*vals)]
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_spec,
                                 check_vma=False), donate_argnums=tuple(range(donate)))


class MpmdProgram:
    """The MPMD step for one input signature, built on a planned ``PipelineProgram``."""

    def __init__(self, prog, devices):
        """``devices``: per pipeline rank, its devices (one, its ``dp`` group, or its
        sub-mesh over ``prog.sub``'s axes, in mesh order)."""
        self.prog, self.p, self.S, self.m = prog, prog.p, prog.S, prog.m
        self.sub = prog.sub
        groups = [list(np.asarray(g, dtype=object).reshape(-1)) for g in devices]
        if len(groups) != self.p:
            raise ShardingError(f'Pipeline(lowering="mpmd"): {len(groups)} device groups for {self.p} ranks')
        # several processes: each runs the same driver, but only its own ranks' programs
        self.multi = jax.process_count() > 1
        self.local = [all(x.process_index == jax.process_index() for x in g) for g in groups]
        self.group_lists = groups
        if self.multi:
            self._check_ranks_in_one_process(groups)
            self.xfers = Transfers([x for g in groups for x in g])
        self.dp = len(groups[0])
        self.devices = [g[0] for g in groups]   # per rank, its first device (its only one without dp)
        self.groups = [frozenset(g) for g in groups]
        if self.sub is not None:
            # a planned per-rank program (tensor parallel, ZeRO): its inputs and outputs under
            # their planned layouts; every other value is a device's own, stacked over the group
            sub = self.sub
            self.meshes = [Mesh(np.asarray(g, dtype=object).reshape(sub.sizes), tuple(sub.axes)) for g in groups]
            self.whole = self.rows = [NamedSharding(mh, P(tuple(sub.axes))) for mh in self.meshes]
        elif self.dp == 1:
            self.whole = self.rows = [SingleDeviceSharding(g[0]) for g in groups]
        else:
            # a rank's values: replicated over its dp group (state, once results) or split on dim 0
            # (the batch rows, and each device's own values stacked on a leading dp dim)
            self.meshes = [Mesh(np.asarray(g, dtype=object), ("dp",)) for g in groups]
            self.whole = [NamedSharding(mh, P()) for mh in self.meshes]
            self.rows = [NamedSharding(mh, P("dp")) for mh in self.meshes]
        self.j = prog.j
        self.consts = dict(zip(self.j.constvars, prog.consts))
        # (from rank, to rank, what) of the transfers a call makes: the tick loop's, the once phases'
        self.transfers, self.once_transfers = [], []
        self.input_transfers = []               # inputs (state, batch) moved from one rank's device to another's
        self._copies = []                       # (array returned, {rank: its copy here}, every rank holding it)
        self._splits = {}                       # small jitted helpers: batch splits, dp sums, output layouts
        self._plan_actions()
        self._plan_once()
        self._compile_code()

    def _check_ranks_in_one_process(self, groups):
        """A rank's programs run in one process: refuse a rank whose devices span several."""
        for d, g in enumerate(groups):
            procs = sorted({x.process_index for x in g})
            if len(procs) > 1:
                stages = [k for k in range(self.S) if self.prog.rank_of(k) == d]
                raise ShardingError(
                    f'Pipeline(lowering="mpmd"): pipeline rank {d} (stage{"s" if len(stages) > 1 else ""} '
                    f'{", ".join(map(str, stages))}) runs on devices {[int(x.id) for x in g]}, which belong to '
                    f'processes {procs}; the MPMD lowering runs each rank\'s programs in one process. Fix: give each '
                    f'process whole ranks (the pipeline axis first in the mesh, e.g. mesh=(({self.p}, '
                    f'{len(g)}), ("pp", "dp")), and {len(g)} or a multiple of {len(g)} devices per process: '
                    'shardprop launch --devices-per-proc), or use lowering="spmd"')

    # ---------------------------------------------------------------- planning
    def _plan_actions(self):
        """Per (kind, model stage): the program's inputs (in order), where each comes from,
        and its outputs: what it sends, keeps for its backward, accumulates and outputs."""
        prog = self.prog
        # what a stage receives, in the order its neighbour sends it (both deduplicated, as
        # the SPMD lowering's packing pairs them)
        self.fwd_in = {k: _unique(prog.fwd_in.get(k, [])) for k in range(self.S)}
        self.bwd_in = {k: _unique(prog.bwd_in.get(k, [])) for k in range(self.S)}
        self.actions = {}
        for (kind, k), pr in prog.progs.items():
            reads = [v for v in pr["reads"] if v not in self.consts]
            sends = _unique(a for a in pr["sends"] if not _lit(a))
            keep = list(prog.resid[k].vars) if kind == F_ else []
            accs = _unique(pr["accs"])
            outs_b = _unique(pr["outs_b"])
            self.actions[(kind, k)] = dict(idxs=pr["idxs"], reads=reads, sends=sends, keep=keep, accs=accs,
                                           outs_b=outs_b, fns={})

    def _action_fn(self, kind, k, first: bool):
        """The jitted action on its rank's device: ``(*acc, *reads) -> (*acc + partial sums,
        *sends, *kept, *outputs)``, the accumulators donated (added in place); ``first``
        (the stage's first accumulating action, or none to add): ``(*reads) -> (partial
        sums, ...)``."""
        a = self.actions[(kind, k)]
        if first in a["fns"]:
            return a["fns"][first]
        prog, reads = self.prog, a["reads"]
        d = prog.rank_of(k)
        nacc = 0 if first else len(a["accs"])

        def run(*vals):
            env = dict(self.consts)
            env.update(zip(reads, vals[nacc:]))
            prog._run(a["idxs"], env)
            part = [env[v] for v in a["accs"]]
            summed = part if not nacc else [x + y for x, y in zip(vals[:nacc], part)]
            return summed + [env[v] for v in a["sends"] + a["keep"] + a["outs_b"]]
        if self.sub is not None:
            fn = self._per_device(run, d, ["stacked"] * nacc + [self._arg_kind(v) for v in reads], reads,
                                  donate=nacc)
        elif self.dp == 1:
            fn = jax.jit(run, out_shardings=self.whole[d], donate_argnums=tuple(range(nacc)))
        else:
            # each device of the group runs the per-device program on its rows; what it
            # produces stays its own (stacked on a leading dp dim), summed over dp after the ticks
            kinds = ["stacked"] * nacc + [self._arg_kind(v) for v in reads]
            spec = {"stacked": P("dp"), "rows": P("dp"), "whole": P()}
            fn = _stacked_map(run, self.meshes[d], kinds, [spec[kd] for kd in kinds], P("dp"), donate=nacc)
        a["fns"][first] = fn
        return fn

    def _per_device(self, run, d, kinds, reads, donate=0):
        """``run`` (the per-rank program's equations) as a ``shard_map`` over rank ``d``'s
        sub-mesh: inputs of the step under their planned layouts, stacked values as each
        device's own; every result stacked."""
        sub, axes = self.sub, tuple(self.sub.axes)
        nstack = len(kinds) - len(reads)
        specs = [P(axes)] * nstack + [sub.spec(sub.in_dims[self.prog.invar_index[v]]) if kd != "stacked"
                                      else P(axes) for kd, v in zip(kinds[nstack:], reads)]
        return _stacked_map(run, self.meshes[d], kinds, specs, P(axes), donate=donate)

    def _out_fn(self, d, n):
        """A stacked value of rank ``d`` -> the step's output ``n`` under its planned layout."""
        key = ("out", d, n)
        if key not in self._splits:
            sub = self.sub
            self._splits[key] = jax.jit(jax.shard_map(lambda x: x[0], mesh=self.meshes[d],
                                                      in_specs=P(tuple(sub.axes)),
                                                      out_specs=sub.spec(sub.out_dims[n]), check_vma=False))
        return self._splits[key]

    def _in_sharding(self, i, d):
        """Where input ``i`` lies on rank ``d``: replicated, its rows split over dp, or (a
        planned sub-mesh) its planned layout."""
        if self.sub is not None:
            return NamedSharding(self.meshes[d], self.sub.spec(self.sub.in_dims[i]))
        return self.rows[d] if self.prog.batch_mask[i] else self.whole[d]

    def _arg_kind(self, v) -> str:
        """How an action's input lies on its dp group: ``"rows"`` (a micro-batch, split on
        dim 0), ``"whole"`` (state, replicated) or ``"stacked"`` (a per-device value)."""
        i = self.prog.invar_index.get(v)
        if i is None:
            return "stacked"
        return "rows" if self.prog.batch_mask[i] else "whole"

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
        # where a REP op runs: every rank that needs one of its results (the SPMD lowering's
        # fixed point; a result no rank reads and no input is tied to runs on one rank, below)
        owners = {i: set(in_readers.get(v, ())) for i, v in enumerate(j.invars)}
        run_on = rep_needed(j, rep_ops, users, readers, outs_at, prog.ties or {}, owners, untied=set())
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
            if self.sub is not None:
                s["fn"] = self._per_device(run, s["rank"], [self._arg_kind(v) for v in reads], reads)
            else:
                s["fn"] = jax.jit(run, out_shardings=self.whole[s["rank"]])
        return s["fn"]

    # ---------------------------------------------------------------- the driver's code
    def _compile_code(self):
        """Walk the tick table once, symbolically: every value becomes a register, every
        action a ``run`` instruction (its jitted program, argument and result registers)
        and every exchange a ``move`` (``jax.device_put`` to the neighbour's device). A
        call then only executes this list, so the driver's Python work per action is a
        list lookup (on 2 shared cores it competes with the stages for the CPU)."""
        prog, j, m, p = self.prog, self.j, self.m, self.p
        invar_index = prog.invar_index
        nreg = [0]

        def reg():
            nreg[0] += 1
            return nreg[0] - 1
        code, moves, once_moves = [], [], []
        self.loads = {}             # (input, rank) -> register
        self.batch_loads = {}       # (input, rank) -> [register per micro-batch]

        def input_reg(i, d, mb=None):
            if prog.batch_mask[i]:
                if (i, d) not in self.batch_loads:
                    self.batch_loads[(i, d)] = [reg() for _ in range(m)]
                return self.batch_loads[(i, d)][mb]
            if (i, d) not in self.loads:
                self.loads[(i, d)] = reg()
            return self.loads[(i, d)]

        held = {}                   # register -> (rank, bytes) of the activations a rank holds

        pending = []                # this tick's moves: one device_put call for all of them

        code_at = []               # per instruction: its rank (run), or its (from, to, aval) per value (move)

        def move(r, src, dst, label, log, v):
            out = reg()
            if r in held:
                held[out] = (dst, held[r][1])
            where = (self.rows if label != "once" else self.whole)[dst]
            pending.append((r, out, where, (src, dst, self._aval(v, label))))
            log.append((src, dst, label))
            return out

        def flush():
            if pending:
                code.append(("move",) + tuple(list(x) for x in zip(*pending))[:3])
                code_at.append([x[3] for x in pending])
                pending.clear()

        acts, cts, kept, acc, outs_b, outs_b_rank = {}, {}, {}, {}, {}, {}
        for tick in tick_actions(prog):
            for d, act in tick:
                k = prog.schedule.model_stage(d, act.chunk)
                kind, mb = act.kind, act.microbatch
                a = self.actions[(kind, k)]
                env = dict(acts.get((k, mb), {}))
                if kind != F_:
                    env.update(kept.get((k, mb), {}))
                    env.update(cts.get((k, mb), {}))
                args = []
                for v in a["reads"]:
                    if v in env:
                        args.append(env[v])
                    elif v in invar_index:
                        args.append(input_reg(invar_index[v], d, mb))
                    else:
                        raise ShardingError(f"pipeline (mpmd): {kind} of stage {k} reads {v} ({v.aval}), which no "
                                            "earlier action provides; use lowering=\"spmd\"")
                first = not a["accs"] or k not in acc or not all(v in acc[k] for v in a["accs"])
                if not first:
                    args = [acc[k][v] for v in a["accs"]] + args
                outs = {name: [reg() for _ in a[name]] for name in ("accs", "sends", "keep", "outs_b")}
                for v, r in zip(a["sends"] + a["keep"], outs["sends"] + outs["keep"]):
                    held[r] = (d, _nbytes(v))
                code.append(("run", self._action_fn(kind, k, first), args,
                             outs["accs"] + outs["sends"] + outs["keep"] + outs["outs_b"]))
                code_at.append(d)
                if a["accs"]:
                    acc.setdefault(k, {}).update(zip(a["accs"], outs["accs"]))
                if a["keep"]:
                    kept[(k, mb)] = dict(zip(a["keep"], outs["keep"]))
                for v, r in zip(a["outs_b"], outs["outs_b"]):
                    outs_b.setdefault(v, [None] * m)[mb] = r
                    outs_b_rank[v] = d
                if kind == F_ and k + 1 < self.S and a["sends"]:
                    d2 = prog.rank_of(k + 1)
                    acts[(k + 1, mb)] = {v: move(r, d, d2, "activation", moves, v)
                                         for v, r in zip(self.fwd_in[k + 1], outs["sends"])}
                elif kind in (B_, I_) and k > 0 and a["sends"]:
                    d2 = prog.rank_of(k - 1)
                    cts[(k - 1, mb)] = {v: move(r, d, d2, "cotangent", moves, v)
                                        for v, r in zip(self.bwd_in[k - 1], outs["sends"])}
            flush()
        self.actions_dispatched = sum(1 for ins in code if ins[0] == "run")
        if self.dp > 1 and self.sub is None:
            # each stage's partial sums over its dp group: summed once, before the once ops
            for k, regs in acc.items():
                d = prog.rank_of(k)
                summed = [reg() for _ in regs]
                code.append(("run", self._sum_fn(d), list(regs.values()), summed))
                code_at.append(d)
                acc[k] = dict(zip(regs, summed))
        # the once phases: per rank its registers by var
        envs = [dict() for _ in range(p)]
        homes = {}
        for k, regs in acc.items():
            for v, r in regs.items():
                envs[prog.rank_of(k)][v] = r
                homes.setdefault(v, []).append(prog.rank_of(k))
        for s_ in self.segments:
            d = s_["rank"]
            args = []
            for v in s_["reads"]:
                if v in envs[d]:
                    args.append(envs[d][v])
                elif v in invar_index:
                    args.append(input_reg(invar_index[v], d))
                elif v in homes:
                    src = homes[v][0]
                    envs[d][v] = move(envs[src][v], src, d, "once", once_moves, v)
                    flush()
                    homes[v].append(d)
                    args.append(envs[d][v])
                else:
                    raise ShardingError(f"pipeline (mpmd): the once ops on rank {d} read {v} ({v.aval}), which no "
                                        "earlier program computes; use lowering=\"spmd\"")
            outs = [reg() for _ in s_["outs"]]
            code.append(("run", self._segment_fn(s_), args, outs))
            code_at.append(d)
            for v, r in zip(s_["outs"], outs):
                envs[d][v] = r
                homes.setdefault(v, []).append(d)
        # the step's outputs
        self.outputs = []
        for v, spec in zip(j.outvars, prog.out_spec):
            if spec[0] in ("literal", "input", "float"):
                self.outputs.append(spec)
            elif spec[0] == "batched":
                self.outputs.append(("batched", outs_b[v], prog.an.bdim[v], outs_b_rank[v]))
            elif not homes.get(v):
                raise ShardingError(f"pipeline (mpmd): the step's output {v} ({v.aval}) is not computed; use "
                                    "lowering=\"spmd\"")
            else:
                self.outputs.append(("regs", [envs[d][v] for d in homes[v]], list(homes[v])))
        # each register is dropped after its last reader (what 1F1B keeps in flight, not GPipe's)
        keep = {r for o in self.outputs if o[0] in ("regs", "batched") for r in (o[1] if o[0] == "regs" else o[1])}
        last = {}
        for n, ins in enumerate(code):
            for r in ins[2] if ins[0] == "run" else ins[1]:
                last[r] = n
        frees = [[] for _ in code]
        for r, n in last.items():
            if r not in keep:
                frees[n].append(r)
        self.code = [ins + (tuple(f),) for ins, f in zip(code, frees)]
        self.code_at = code_at
        # what this process executes: everything with one process, its ranks' part with several
        self.local_code = self._localize() if self.multi else self.code
        self.nreg = nreg[0]
        self.transfers, self.once_transfers = moves, once_moves
        # per rank, the most activation bytes (sent, received, kept for a backward) it holds
        # at once, in dispatch order: the schedule's in flight (1F1B about p-d, GPipe m)
        live, self.peak_activation_bytes = [0] * p, [0] * p
        for ins in self.code:
            for r in ins[3] if ins[0] == "run" else ins[2]:
                if r in held:
                    live[held[r][0]] += held[r][1]
            self.peak_activation_bytes = [max(a, b) for a, b in zip(self.peak_activation_bytes, live)]
            for r in ins[-1]:
                if r in held:
                    live[held[r][0]] -= held[r][1]

    def _aval(self, v, label):
        """The shape of a moved register of var ``v``: each device's own value, stacked on a
        leading dim over the rank's devices (dp without a sub-mesh: not the once values,
        summed over dp by then), or ``v``'s own."""
        shape = tuple(v.aval.shape)
        if self.sub is not None or (self.dp > 1 and label != "once"):
            shape = (self.dp,) + shape
        return jax.ShapeDtypeStruct(shape, v.aval.dtype)

    def _localize(self):
        """This process's part of ``self.code``: the programs of the ranks it owns; a move
        between two of its ranks stays a ``device_put``; one to or from another process's
        rank becomes an ``xfer`` (one program both processes run, per pair of ranks of a
        move instruction, in the code's order); moves between other processes' ranks and
        other ranks' programs are left out (their registers' frees move to the next kept
        instruction)."""
        out, carry, here = [], (), self.local
        for ins, at in zip(self.code, self.code_at):
            frees = carry + ins[-1]
            new = []
            if ins[0] == "run":
                if here[at]:
                    new.append(ins[:-1])
            else:
                _, srcs, dsts, wheres, _ = ins
                rows = list(zip(srcs, dsts, wheres, at))
                same = [r for r in rows if here[r[3][0]] and here[r[3][1]]]
                if same:
                    new.append(("move",) + tuple(list(x) for x in zip(*same))[:3])
                cross = {}
                for r in rows:
                    if here[r[3][0]] != here[r[3][1]]:
                        cross.setdefault(r[3][:2], []).append(r)
                for (a, b), rs in cross.items():
                    avals = [r[3][2] for r in rs]
                    # the sender's layout: the receiver's, mirrored onto the sender's devices
                    src_sh = [mirrored(r[2], self.group_lists[a]) for r in rs]
                    new.append(("xfer", a, b, [r[0] for r in rs], [r[1] for r in rs], avals, src_sh,
                                [r[2] for r in rs]))
            if new:
                out.extend(x + ((),) for x in new[:-1])
                out.append(new[-1] + (frees,))
                carry = ()
            else:
                carry = frees
        return out

    def _xfer(self, vals, ins):
        """Run one cross-process move of ``_localize``'s: this process sends or receives."""
        _, a, b, srcs, dsts, avals, src_sh, wheres, _ = ins
        got = self.xfers.move([vals[r] for r in srcs] if self.local[a] else [None] * len(srcs), avals, src_sh,
                              self.group_lists[b])
        if got is not None:
            for r, x, w in zip(dsts, got, wheres):
                vals[r] = x if x.sharding.is_equivalent_to(w, x.ndim) else jax.device_put(x, w)

    def _split_fn(self, i, d):
        """Batch leaf ``i`` (on rank ``d``, its rows split over dp) -> its ``m`` micro-batches."""
        if (i, d) not in self._splits:
            m = self.m
            self._splits[(i, d)] = jax.jit(lambda x: [x[n * (x.shape[0] // m):(n + 1) * (x.shape[0] // m)]
                                                      for n in range(m)], out_shardings=self._in_sharding(i, d))
        return self._splits[(i, d)]

    def _sum_fn(self, d):
        """Per-device partial sums (stacked over rank ``d``'s dp group) -> their sum, on every
        device of the group (an all-reduce over dp)."""
        if ("sum", d) not in self._splits:
            self._splits[("sum", d)] = jax.jit(lambda *xs: [x.sum(0) for x in xs], out_shardings=self.whole[d])
        return self._splits[("sum", d)]

    def _put(self, x, i, d, what="input"):
        """Input ``i``'s value ``x`` on rank ``d``'s devices (``_in_sharding``); logged
        (``(from, to, what, shape)``) when it comes from another rank's devices."""
        src = _rank_of_array(x, self.groups)
        target = self._in_sharding(i, d)
        if src == d and (self.dp == 1 or x.sharding.is_equivalent_to(target, x.ndim)):
            return x
        if src is not None and src != d:
            self.input_transfers.append((src, d, what, tuple(x.shape)))
        return jax.device_put(x if isinstance(x, jax.Array) else np.asarray(x), target)

    def __call__(self, leaves):
        vals = [None] * self.nreg
        self.input_transfers = []
        self._load(leaves, vals)
        for ins in self.local_code:
            if ins[0] == "run":
                _, fn, args, outs, frees = ins
                for r, x in zip(outs, fn(*[vals[a] for a in args])):
                    vals[r] = x
            elif ins[0] == "move":
                _, srcs, dsts, where, frees = ins
                for r, x in zip(dsts, jax.device_put([vals[a] for a in srcs], where)):
                    vals[r] = x
            else:
                self._xfer(vals, ins)
                frees = ins[-1]
            for r in frees:
                vals[r] = None
        if self.multi:
            return self._outputs_multi(vals, leaves)
        outs, new_copies = [], []
        for n, spec in enumerate(self.outputs):
            if spec[0] == "literal":
                outs.append(jnp.asarray(spec[1]))
            elif spec[0] == "input":
                outs.append(leaves[spec[1]])
            elif spec[0] == "float":
                outs.append(None)                   # filled by the caller (computed from inputs only)
            elif spec[0] == "batched":
                outs.append(self._rows(vals, n, spec))
            else:
                held = {d: vals[r] for d, r in zip(spec[2], spec[1])}
                if self.sub is not None:
                    held = {d: self._out_fn(d, n)(x) for d, x in held.items()}
                x = held[spec[2][0]]
                outs.append(x)
                if len(held) > 1:
                    new_copies.append((x, held, set(held)))
        self._copies = new_copies
        return outs

    # ---------------------------------------------------------------- several processes
    def _host_side(self, x, i):
        """Input ``i``'s value as this process can place it on its ranks: host data, a
        process-local array, a replicated global array's local copy, or (a global array
        over several processes, laid out otherwise) gathered from every process."""
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.sharding.is_fully_replicated and x.addressable_shards:
            return x.addressable_data(0)
        procs = {dev.process_index for dev in x.devices()}
        if len(procs) > 1:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        raise ShardingError(f'Pipeline(lowering="mpmd"): input {self.prog.j.invars[i]} ({x.shape}) lies on devices '
                            f'{sorted(int(dev.id) for dev in x.devices())} of process {procs.pop()} alone, and not on one '
                            'pipeline rank\'s devices as every process sees it: pass host data (numpy), the step\'s '
                            'outputs, or state restored (sp.Checkpointer) into the layouts they were saved from')

    def _load(self, leaves, vals):
        """The inputs on this process's ranks. A state input that a rank holds (the step's
        own output there) is read there, or comes over from its (lowest) holder: a copy
        within a process, a move both processes take part in between two. Any other input
        is each process's own copy (host data, or an array on its devices), placed on its
        ranks. Over several processes every process walks the loads in the same order and
        takes the same decisions: whether an input is the step's output is the same on all
        of them, where an array of its own lies is not (jax puts it on each process's first
        device)."""
        copies = {id(x): (x, c, homes) for x, c, homes in self._copies}
        spanning = {}                   # inputs gathered from every process (once each)
        if self.multi:
            copies.update(self._held_by_a_rank(leaves, copies))
            for i in sorted({i for i, _ in list(self.loads) + list(self.batch_loads)}):
                x = leaves[i]
                if isinstance(x, jax.Array) and id(x) not in copies and \
                        len({dev.process_index for dev in x.devices()}) > 1 and not x.sharding.is_fully_replicated:
                    spanning[i] = self._host_side(x, i)
        for (i, d), r in self.loads.items():
            x = leaves[i]
            kept = copies.get(id(x))
            if kept is None or kept[0] is not x:             # not the step's output: this process's own
                if self.local[d]:
                    vals[r] = self._put(spanning[i] if i in spanning else self._host_side(x, i), i, d)
                continue
            if d in kept[2]:                                 # the step's output, held on rank d already
                if self.local[d]:
                    vals[r] = kept[1][d]
                continue
            src = min(kept[2])
            if self.local[src] and self.local[d]:
                vals[r] = self._put(kept[1][src], i, d)
            elif self.local[src] or self.local[d]:
                # from its (lowest) holder, in its layout there (known to both processes)
                got = self.xfers.move([kept[1][src]] if self.local[src] else [None],
                                      [jax.ShapeDtypeStruct(x.shape, x.dtype)],
                                      [mirrored(x.sharding, self.group_lists[src])], self.group_lists[d])
                self.input_transfers.append((src, d, "input", tuple(x.shape)))
                if got is not None:
                    vals[r] = self._put(got[0], i, d)
        for (i, d), regs in self.batch_loads.items():
            if self.local[d]:
                x = spanning[i] if i in spanning else self._host_side(leaves[i], i)
                for r, x in zip(regs, self._split_fn(i, d)(self._put(x, i, d, "batch"))):
                    vals[r] = x

    def _held_by_a_rank(self, leaves, copies) -> dict:
        """The inputs that are not this program's own last outputs but lie on exactly one
        rank's devices on every process (another signature's outputs, or state restored
        by ``sp.Checkpointer`` into the layouts it was saved from), as ``copies`` entries:
        they move from that rank like the step's own state. An array of the process's own
        is alike on the rank that holds it, so every process says which rank it sees each
        input on (one small all-gather), and only an input seen on the same rank by every
        process is taken as held there."""
        loaded = sorted({i for i, _ in self.loads if id(leaves[i]) not in copies})
        if not loaded:
            return {}
        from jax.experimental import multihost_utils
        seen = [_rank_of_array(leaves[i], self.groups) for i in loaded]
        every = np.asarray(multihost_utils.process_allgather(np.asarray([-1 if r is None else r for r in seen],
                                                                        dtype=np.int32))).reshape(-1, len(loaded))
        out = {}
        for n, i in enumerate(loaded):
            d = int(every[0, n])
            if d >= 0 and (every[:, n] == d).all():
                x = leaves[i]
                out[id(x)] = (x, {d: x} if self.local[d] else {}, {d})
        return out

    def _rows(self, vals, n, spec):
        """A per-example output (``("batched", registers, batch dim, rank)``): each
        micro-batch's value, as one array, concatenated along the batch dim in micro-batch
        order. With dp each device's rows, in dp order; beside a planned sub-mesh each
        micro-batch's stacked per-device values under the output's planned layout."""
        regs, bd, h = spec[1], spec[2], spec[3]
        parts = [vals[r] for r in regs]
        if self.sub is not None:
            parts = [self._out_fn(h, n)(x) for x in parts]
        elif self.dp > 1:
            parts = [jnp.moveaxis(x, 0, bd).reshape(x.shape[1:bd + 1] + (-1,) + x.shape[bd + 2:]) for x in parts]
        return jnp.concatenate(parts, axis=bd) if len(parts) > 1 else parts[0]

    def _state_sharding(self, d, n):
        """Where output ``n`` lies on rank ``d``, and its shape: a stage's state."""
        v = self.j.outvars[n]
        if self.sub is not None:
            return NamedSharding(self.meshes[d], self.sub.spec(self.sub.out_dims[n])), tuple(self.sub.out_shapes[n])
        return self.whole[d], tuple(v.aval.shape)

    def _outputs_multi(self, vals, leaves):
        """The step's outputs as the SPMD lowering returns them over several processes: a
        stage's state stays on its rank's devices (a global array; a process without that
        rank holds no block of it), and a value every rank's caller reads (the loss, a
        metric, a forward's batched output) is replicated on every device of the mesh."""
        outs, new_copies = [], []
        for n, spec in enumerate(self.outputs):
            kind, v = self.prog.out_spec[n][0], self.j.outvars[n]
            if spec[0] == "literal":
                outs.append(jnp.asarray(spec[1]))
            elif spec[0] == "input":
                outs.append(leaves[spec[1]])
            elif spec[0] == "float":
                outs.append(None)
            elif spec[0] == "batched":
                h, bd = spec[3], spec[2]
                x = self._rows(vals, n, spec) if self.local[h] else None
                shape = list(v.aval.shape) if self.sub is None else list(self.sub.out_shapes[n])
                shape[bd] *= self.m * (self.dp if self.sub is None else 1)
                outs.append(self.xfers.broadcast(x, jax.ShapeDtypeStruct(tuple(shape), v.aval.dtype),
                                                 self.group_lists[h]))
            else:
                homes = list(spec[2])
                held = {d: vals[r] for d, r in zip(homes, spec[1]) if self.local[d]}
                if self.sub is not None:
                    held = {d: self._out_fn(d, n)(x) for d, x in held.items()}
                h = homes[0]
                if kind in ("packed", "shared"):
                    where, shape = self._state_sharding(h, n)
                    x = held[h] if self.local[h] else empty_like_on(shape, v.aval.dtype, where)
                    new_copies.append((x, held, set(homes)))
                else:
                    shape = self._state_sharding(h, n)[1]
                    x = self.xfers.broadcast(held.get(h), jax.ShapeDtypeStruct(shape, v.aval.dtype),
                                             self.group_lists[h])
                outs.append(x)
        self._copies = new_copies
        return outs

    def param_bytes(self) -> list:
        """Per rank, the bytes of the step's inputs stored there (its parameters and
        optimizer state, and what several ranks read: Adam's step count), at their own
        shapes, per device."""
        per = [0] * self.p
        for v, ds in self.input_ranks.items():
            if not self.prog.batch_mask[self.prog.invar_index[v]]:
                for d in ds:
                    per[d] += _nbytes(v)
        return per


def _nbytes(v) -> int:
    """Bytes of a value per device (one device's rows with dp)."""
    return int(np.prod(v.aval.shape, dtype=np.int64)) * np.dtype(v.aval.dtype).itemsize


def _rank_of_array(x, groups):
    """The rank whose devices hold ``x``, or None (host data, or other devices)."""
    if not isinstance(x, jax.Array):
        return None
    try:
        devs = frozenset(x.devices())
    except Exception:                               # noqa: BLE001 (a tracer or deleted array)
        return None
    return groups.index(devs) if devs in groups else None
