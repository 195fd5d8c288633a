"""Stage assignment and micro-batch analysis of a traced training (or inference) step.

Input: the whole step traced twice with ``jax.make_jaxpr`` (calls inlined), once on the
global batch and once on one micro-batch (the batch arguments' dim 0 divided by ``m``;
with ``m == 1`` the second trace doubles the batch instead, only to find the batch dims).
Both traces have the same equations; comparing each value's shape between them gives its
**batch dim** (the one dim whose size scales with the batch). The micro-batch trace is the
one the lowering runs, so every shape parameter (reshape sizes, broadcast shapes, iota) is
already a micro-batch's; a literal or constant whose value differs between the traces (a
mean's ``1/B``) takes the global trace's value, so the per-micro-batch partial sums add
up to the global step's.

Every equation gets one of these roles:

- ``float``: reads only step inputs and constants (parameter transposes, the batch's
  label one-hots...): computed wherever it is needed, in any program that reads it;
- ``mb`` (per micro-batch): reads a staged value; it belongs to one **model stage** and
  one **phase** (``F`` forward, ``B`` backward). Its results carry the batch dim, or, for
  a batch-contracting op (``reduce_sum``, ``dot_general``, ``conv``), none: those are
  **partial sums over micro-batches** (``acc``), accumulated across micro-batches;
- ``once``: reads an accumulated value (the optimizer update, the loss normalisation):
  runs once after the last micro-batch, on the stage (rank) that owns its inputs, or on
  every rank (``REP``) when it combines several stages' values (a tied weight's two
  gradients, a global gradient norm).

Stage of an ``mb`` op: forward marks (``direction="forward"``) are cuts ``0..S-2`` in
program order; the k-th mark's results are stage ``k+1``'s. A forward op is on the
highest stage among its staged inputs. Backward marks are the cuts' transposes
(reversed program order); a backward op is on the lowest stage among its backward
inputs. The last stage's backward ops (before the first backward mark) are the ops that
descend from the cotangent seed (an op of constants only, e.g. ``broadcast_in_dim
1.0``), closed under consumers; the split only moves work between the F and B actions,
program order keeps it correct either way.

Errors (``ShardingError`` with the op, its source line, the shapes and the fix): a
batch-mixing op (a non-additive reduction over the batch, a per-micro-batch op reading an
accumulated value), a value crossing stages other than through a mark, a mark inside a
loop or cond body, a mark count that does not match ``p * v - 1``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np
from jax.extend import core as jcore
from jax._src import source_info_util

from ..ir.errors import ShardingError, sharding_error
from .jaxpr_import import INLINE
from .source_lines import source_of

PARTIAL_PRODUCERS = ("reduce_sum", "dot_general", "conv_general_dilated")
LAYOUT_MOVE = "sp_layout_move"   # compiler/pipeline_submesh.py's scope of a plan's collectives
# ops linear in each operand a cotangent flows through (the backward of a step is built of these)
LINEAR = {"mul", "add", "add_any", "sub", "neg", "dot_general", "transpose", "reshape", "broadcast_in_dim",
          "reduce_sum", "convert_element_type", "select_n", "concatenate", "pad", "slice", "dynamic_slice",
          "dynamic_update_slice", "gather", "scatter-add", "scatter_add", "div", "copy", "copy_p", "squeeze",
          "expand_dims", "rev", "cumsum", "conv_general_dilated", "reduce_precision", "stage_boundary",
          # a planned per-rank program's collectives (compiler/pipeline_submesh.py) are linear too
          "psum", "psum2", "all_gather", "all_to_all", "ppermute", "reduce_scatter", "psum_scatter", "pbroadcast"}
FLOAT, MB, ONCE, MARK = "float", "mb", "once", "mark"
REP = -1    # the home of a once op that combines stages: every rank


def bind_eqn(eqn, ins) -> list:
    """Bind ``eqn``'s primitive on ``ins`` again, under its source line and name stack
    (so errors and dumps still point at the user's code): its outputs, as a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
        outs = eqn.primitive.bind(*ins, **params)
    return outs if eqn.primitive.multiple_results else [outs]


def inline_calls(closed):
    """The closed jaxpr with every call (jit, custom_jvp/vjp, remat) inlined."""
    def run(jaxpr, consts, *args):
        env = {}
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            name = eqn.primitive.name
            if name in INLINE and INLINE[name] in eqn.params:
                body = eqn.params[INLINE[name]]
                if isinstance(body, jcore.ClosedJaxpr):
                    outs = run(body.jaxpr, body.consts, *ins)
                else:
                    outs = run(body, [], *ins)
            else:
                outs = bind_eqn(eqn, ins)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(a) for a in jaxpr.outvars]
    avals = [v.aval for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: run(closed.jaxpr, closed.consts, *a))(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])


def _has_mark(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "stage_boundary":
            return True
        for sub in _subjaxprs(eqn):
            if _has_mark(sub):
                return True
    return False


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for q in (p if isinstance(p, (tuple, list)) else (p,)):
            if isinstance(q, jcore.ClosedJaxpr):
                yield q.jaxpr
            elif isinstance(q, jcore.Jaxpr):
                yield q


def _src(eqn) -> Optional[str]:
    return source_of(eqn.source_info)


@dataclass
class StageProgram:
    """One model stage's ops (equation indices into the micro-batch trace, in order)."""
    forward: list = field(default_factory=list)
    backward: list = field(default_factory=list)
    once: list = field(default_factory=list)
    backward_input: list = field(default_factory=list)    # zero-bubble split of ``backward``
    backward_weight: list = field(default_factory=list)


@dataclass
class Analysis:
    """What the lowering needs; variables are the micro-batch trace's."""
    jaxpr: object                    # micro-batch ClosedJaxpr (calls inlined)
    global_jaxpr: object
    literal_override: dict           # (eqn index, operand index) -> global literal value
    const_override: dict             # constvar index -> global constant
    S: int                           # model stages
    roles: list                      # per eqn: FLOAT, MB, ONCE or MARK
    stage: list                      # per eqn: model stage (mb, once, mark) or None
    phase: list                      # per eqn: "F" / "B" (mb and mark) or None
    stages: list                     # StageProgram per model stage
    fwd_marks: list                  # eqn index per cut
    bwd_marks: list                  # eqn index per cut (None for forward-only)
    bdim: dict                       # var -> batch dim (micro trace vars)
    kind: dict                       # var -> FLOAT / MB / "acc" / ONCE
    var_stage: dict                  # var -> model stage (mb, acc, once)
    producer: dict                   # var -> eqn index
    training: bool
    rep_once: list = field(default_factory=list)   # once ops that combine stages (run on every rank)
    # what crosses each cut: sent by model stage k (to k+1 forward, to k-1 backward), received by k
    fwd_send: dict = field(default_factory=dict)
    fwd_recv: dict = field(default_factory=dict)
    bwd_send: dict = field(default_factory=dict)
    bwd_recv: dict = field(default_factory=dict)
    cuts: object = None              # automatic cuts: per model stage (first, end) forward op (None with marks)


def _batch_dims(j_a, j_b, batch_mask) -> dict:
    """var of ``j_a`` -> the dim whose size differs between the two traces."""
    out = {}
    def cmp(va, vb):
        sa, sb = getattr(va.aval, "shape", ()), getattr(vb.aval, "shape", ())
        diff = [i for i, (x, y) in enumerate(zip(sa, sb)) if x != y]
        if len(sa) != len(sb):
            raise ShardingError("the step's program changes with the batch size (an array's rank differs between a "
                                "trace on the batch and one on a micro-batch); a pipeline needs one program for both")
        if len(diff) > 1:
            return "multi"
        return diff[0] if diff else None
    ja, jb = j_a.jaxpr, j_b.jaxpr
    for va, vb in zip(ja.invars, jb.invars):
        out[va] = cmp(va, vb)
    if len(ja.eqns) != len(jb.eqns):
        raise ShardingError(f"the step's program changes with the batch size ({len(ja.eqns)} ops on a micro-batch, "
                            f"{len(jb.eqns)} on the batch): shape-dependent Python control flow in the step, or "
                            "micro-batches of one row (size-1 dims trace differently); a pipeline needs one program "
                            "for both: use fewer micro-batches")
    for ea, eb in zip(ja.eqns, jb.eqns):
        if ea.primitive != eb.primitive:
            raise ShardingError(f"the step's program changes with the batch size ({ea.primitive.name} vs "
                                f"{eb.primitive.name} at {_src(ea)})")
        for va, vb in zip(ea.outvars, eb.outvars):
            out[va] = cmp(va, vb)
    return out


def _err(problem, eqn, fix, shapes=None):
    shapes = shapes if shapes is not None else tuple(
        tuple(getattr(v.aval, "shape", ())) for v in eqn.invars)
    return sharding_error(problem, operator=eqn.primitive.name, source=_src(eqn), shapes=shapes, fix=fix)


def analyse(j_global, j_micro, j_shape, batch_mask, *, S: int, m: int, global_batch: int,
            auto: bool = False) -> Analysis:
    """Assign the micro trace's equations to model stages and roles (see the module doc).
    ``j_shape`` is the trace compared with ``j_micro`` for the batch dims (``j_global``
    when ``m > 1``). ``auto`` (with ``S == 1``): every batch-dependent op is a stage-0 op,
    for :func:`auto_stages` to cut."""
    jaxpr = j_micro.jaxpr
    for eqn in jaxpr.eqns:
        for sub in _subjaxprs(eqn):
            if _has_mark(sub):
                raise _err("a stage_boundary inside a loop or cond body: a pipeline stage cannot start in the "
                           "middle of one iteration", eqn,
                           "move sp.stage_boundary out of the lax.scan/while_loop/cond (mark the loop's input or "
                           "output instead), or unroll the loop")
    bdim = _batch_dims(j_micro, j_shape, batch_mask)
    # literals and constants that depend on the batch size: the global value
    lit_over, const_over = {}, {}
    if m > 1:
        for i, (ea, eg) in enumerate(zip(jaxpr.eqns, j_global.jaxpr.eqns)):
            for k, (a, g) in enumerate(zip(ea.invars, eg.invars)):
                if isinstance(a, jcore.Literal) and isinstance(g, jcore.Literal):
                    if not np.array_equal(np.asarray(a.val), np.asarray(g.val)):
                        lit_over[(i, k)] = g.val
        for k, (ca, cg) in enumerate(zip(j_micro.consts, j_global.consts)):
            if np.shape(ca) == np.shape(cg) and not np.array_equal(np.asarray(ca), np.asarray(cg)):
                const_over[k] = cg
    kind, vstage, vphase, producer = {}, {}, {}, {}
    for v, b in zip(jaxpr.invars, batch_mask):
        kind[v] = FLOAT
    for v in jaxpr.constvars:
        kind[v] = FLOAT
    n = len(jaxpr.eqns)
    roles, stage, phase = [None] * n, [None] * n, [None] * n
    fwd_marks = [i for i, e in enumerate(jaxpr.eqns)
                 if e.primitive.name == "stage_boundary" and e.params["direction"] == "forward"]
    bwd_marks = [i for i, e in enumerate(jaxpr.eqns)
                 if e.primitive.name == "stage_boundary" and e.params["direction"] == "backward"]
    cut_of_fwd, cut_of_bwd = _cuts(jaxpr, fwd_marks, False), _cuts(jaxpr, bwd_marks, True)
    n_fwd, n_bwd = len(set(cut_of_fwd.values())), len(set(cut_of_bwd.values()))
    if n_fwd != S - 1:
        raise ShardingError(f"the pipeline has {S} model stages (pp x virtual_stages) and needs {S - 1} "
                            f"sp.stage_boundary marks in the forward program; the step has {n_fwd}. "
                            "Mark the values that cross each cut with h = sp.stage_boundary(h), or remove every "
                            "mark to let the compiler cut the program")
    training = bool(bwd_marks) or S == 1
    if bwd_marks and n_bwd != S - 1:
        raise ShardingError(f"{n_bwd} backward images of {S - 1} stage_boundary marks: differentiate "
                            "the whole loss once (one value_and_grad over every stage)")
    # the first stage's forward: the batch-dependent ancestors of the first mark (before it,
    # nothing is staged yet, so they would otherwise float and be recomputed by every program)
    first = set()
    if auto:
        dep = {v for v, b in zip(jaxpr.invars, batch_mask) if b}
        for i, e in enumerate(jaxpr.eqns):
            if any(a in dep for a in e.invars if not isinstance(a, jcore.Literal)):
                dep.update(e.outvars)
                first.add(i)
    elif fwd_marks:
        dep = {v for v, b in zip(jaxpr.invars, batch_mask) if b}
        prod_all = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
        cut0 = [e for e in fwd_marks if cut_of_fwd[e] == 0]
        for e in jaxpr.eqns[:max(cut0)]:
            if any(a in dep for a in e.invars if not isinstance(a, jcore.Literal)):
                dep.update(e.outvars)
        stack = [a for e in cut0 for a in jaxpr.eqns[e].invars if not isinstance(a, jcore.Literal)]
        while stack:
            a = stack.pop()
            i = prod_all.get(a)
            if i is None or i in first or a not in dep:
                continue
            first.add(i)
            stack += [b for b in jaxpr.eqns[i].invars if not isinstance(b, jcore.Literal)]
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [a for a in eqn.invars if not isinstance(a, jcore.Literal)]
        kinds = [kind[a] for a in ins]
        for o in eqn.outvars:
            producer[o] = i
        if bdim.get(eqn.outvars[0]) == "multi" or any(bdim.get(a) == "multi" for a in ins):
            if m > 1:
                raise _err("an array with two batch-sized dims (it mixes batch rows)", eqn,
                           "keep batch rows independent of each other or use microbatches=1")
        if i in cut_of_fwd or i in cut_of_bwd:
            fwd = i in cut_of_fwd
            k = cut_of_fwd[i] if fwd else cut_of_bwd[i]
            src = k if fwd else k + 1
            for a in ins:
                if kind[a] == MB and vstage[a] != src:
                    raise _err(f"stage_boundary mark {k} reads a value of stage {vstage[a]}, not stage {src}: "
                               "marks must follow the program's order", eqn,
                               "place the marks in the order the stages run")
                if kind[a] in ("acc", ONCE):
                    raise _err("a stage_boundary on an accumulated (batch-reduced) value", eqn,
                               "mark per-example activations only")
            roles[i], stage[i], phase[i] = MARK, (k + 1 if fwd else k), ("F" if fwd else "B")
            for o in eqn.outvars:
                kind[o], vstage[o], vphase[o] = MB, stage[i], phase[i]
            continue
        if any(k in ("acc", ONCE) for k in kinds):
            if any(bdim.get(o) is not None for o in eqn.outvars) or MB in kinds:
                raise _err("a batch-mixing op: it combines a value reduced over the whole batch with per-example "
                           f"values, so micro-batches (microbatches={m}) would each see a different statistic",
                           eqn, "compute the statistic per example (layer norm instead of batch norm), or use "
                                "microbatches=1 (not pipelined over micro-batches)")
            # on the one stage whose values it reads; reading several (a tied weight's two
            # gradients, a global gradient norm) makes it replicated (REP): the lowering
            # broadcasts its stage inputs over the pipeline axis and every rank computes it
            sts = {vstage[a] for a in ins if kind[a] in ("acc", ONCE)} - {REP}
            roles[i], stage[i] = ONCE, (sts.pop() if len(sts) == 1 else REP)
            for o in eqn.outvars:
                kind[o], vstage[o] = ONCE, stage[i]
            continue
        if MB not in kinds and i not in first:
            roles[i] = FLOAT
            for o in eqn.outvars:
                kind[o] = FLOAT
            continue
        # a per-micro-batch op
        bins = [a for a in ins if kind[a] == MB and vphase[a] == "B"]
        if bins:
            st, ph = min(vstage[a] for a in bins), "B"
        elif i in first:
            st, ph = 0, "F"
        else:
            st, ph = max(vstage[a] for a in ins if kind[a] == MB), "F"
        for a in ins:
            if kind[a] == MB and vphase[a] == "F" and vstage[a] != st:
                raise _err(f"a value of stage {vstage[a]} is read on stage {st} without a stage_boundary", eqn,
                           "pass every value that crosses a cut through sp.stage_boundary (e.g. "
                           "h, skip = sp.stage_boundary((h, skip)))")
        roles[i], stage[i], phase[i] = MB, st, ph
        outs_b = [bdim.get(o) is not None for o in eqn.outvars]
        if all(outs_b):
            for o in eqn.outvars:
                kind[o], vstage[o], vphase[o] = MB, st, ph
        else:
            batched_in = any(bdim.get(a) is not None for a in ins if kind[a] == MB)
            if batched_in and eqn.primitive.name not in PARTIAL_PRODUCERS and m > 1:
                raise _err(f"a batch-mixing op: {eqn.primitive.name} over the batch dim is not a sum, so it "
                           f"cannot be accumulated over micro-batches (microbatches={m})", eqn,
                           "reduce over the batch with a sum or mean, or use microbatches=1")
            for o in eqn.outvars:
                kind[o], vstage[o], vphase[o] = ("acc" if batched_in else MB), st, ph
        # slicing / concatenating along the batch dim changes which rows a micro-batch holds
        # (a planned program's own local slice to this rank's block of the rows is a layout move)
        if eqn.primitive.name in ("slice", "pad", "concatenate", "dynamic_slice", "gather", "rev", "sort",
                                  "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp") and m > 1 \
                and LAYOUT_MOVE not in str(eqn.source_info.name_stack):
            o = eqn.outvars[0]
            for a in ins:
                if bdim.get(a) is not None and bdim.get(o) is not None:
                    gsz = None
                    if eqn.primitive.name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort",
                                              "rev"):
                        axes = eqn.params.get("axis", eqn.params.get("dimension", eqn.params.get("dimensions")))
                        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
                        if bdim[a] in axes:
                            gsz = -1
                    elif a.aval.shape[bdim[a]] != o.aval.shape[bdim[o]]:
                        gsz = -1
                    if gsz is not None:
                        raise _err(f"a batch-mixing op: {eqn.primitive.name} along the batch dim", eqn,
                                   "keep batch rows independent, or use microbatches=1")
    # the last stage's backward (before the first backward mark): the cotangent seed's descendants
    if training and S >= 1:
        pure = set()
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [a for a in eqn.invars if not isinstance(a, jcore.Literal)]
            if roles[i] == FLOAT and all(a in pure for a in ins) and not any(a in jaxpr.invars for a in ins):
                for o in eqn.outvars:
                    pure.add(o)
        first_b = bwd_marks[0] if bwd_marks else n
        scope = [i for i in range(first_b) if roles[i] == MB and stage[i] == S - 1]
        users = {}
        for i in scope:
            for a in jaxpr.eqns[i].invars:
                if not isinstance(a, jcore.Literal):
                    users.setdefault(a, []).append(i)
        # a seed is a constant with the batch shape whose every descendant is linear in it (the
        # cotangent's path); a forward constant (an attention mask) reaches a nonlinear op
        seeded_ops = set()
        for root in [a for a in pure if bdim.get(a) is not None and a in users]:
            desc, stack = set(), [root]
            while stack:
                for u in users.get(stack.pop(), []):
                    if u not in desc:
                        desc.add(u)
                        stack += list(jaxpr.eqns[u].outvars)
            if all(jaxpr.eqns[u].primitive.name in LINEAR for u in desc):
                seeded_ops |= desc
        seeded = set()
        for i in sorted(seeded_ops):
            phase[i] = "B"
            for o in jaxpr.eqns[i].outvars:
                seeded.add(o)
                vphase[o] = "B"
        if auto and seeded_ops:
            _late_forward_to_backward(jaxpr, roles, phase, vphase, producer)
        if S == 1 and not bwd_marks and not seeded:
            training = False
    stages = [StageProgram() for _ in range(S)]
    rep_once = [i for i in range(n) if roles[i] == ONCE and stage[i] == REP]
    for i in range(n):
        if roles[i] == MB:
            (stages[stage[i]].forward if phase[i] == "F" else stages[stage[i]].backward).append(i)
        elif roles[i] == ONCE and stage[i] != REP:
            stages[stage[i]].once.append(i)
    an = Analysis(j_micro, j_global, lit_over, const_over, S, roles, stage, phase, stages, fwd_marks,
                  bwd_marks if bwd_marks else None, bdim, kind, vstage, producer, training, rep_once)
    lit = lambda vs: [a for a in vs if not isinstance(a, jcore.Literal)]
    for e in fwd_marks:
        k = cut_of_fwd[e]
        an.fwd_send.setdefault(k, []).extend(lit(jaxpr.eqns[e].invars))
        an.fwd_recv.setdefault(k + 1, []).extend(jaxpr.eqns[e].outvars)
    for e in bwd_marks:
        k = cut_of_bwd[e]
        an.bwd_recv.setdefault(k, []).extend(jaxpr.eqns[e].outvars)
        an.bwd_send.setdefault(k + 1, []).extend(lit(jaxpr.eqns[e].invars))
    # zero-bubble split: I = what the cotangent sent back needs, W = what the weight partials need
    _split_zero_bubble(an)
    return an


def _late_forward_to_backward(jaxpr, roles, phase, vphase, producer) -> None:
    """Per-micro-batch ops after the forward's end (its last op that the step's outputs
    read through forward ops: the loss) that read forward values only and whose every
    reader is a backward op become backward ops. A planned program's own layout move of
    an activation for a weight gradient (pp x dp x mp with ZeRO-1: the slice of a layer
    norm's output to this rank's block, for its scale's gradient) sits among the
    backward ops; as a forward op it came after the forward's last op, the automatic
    cuts put it on the last stage, and the gradient it feeds, on the stage of its layer,
    read it from a later stage (a ShardingError). As a backward op it runs on the stage
    of the forward values it reads. (Residuals jax computes in the forward, before its
    end, stay forward ops: they are the layers' own ops.) ``producer``: each value's
    equation, as ``analyse`` built it."""
    outs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    # the forward's end: the outputs' ancestors through forward and once ops (not the backward)
    end, seen, stack = -1, set(), [producer[v] for v in outs if v in producer]
    while stack:
        i = stack.pop()
        if i in seen or not (roles[i] == ONCE or roles[i] == MB and phase[i] == "F"):
            continue
        seen.add(i)
        if roles[i] == MB:
            end = max(end, i)
        stack += [producer[a] for a in jaxpr.eqns[i].invars if not isinstance(a, jcore.Literal) and a in producer]
    for i in reversed(range(end + 1, len(jaxpr.eqns))):
        if roles[i] != MB or phase[i] != "F":
            continue
        users = [u for o in jaxpr.eqns[i].outvars for u in _users(jaxpr, o)]
        if users and not any(o in outs for o in jaxpr.eqns[i].outvars) and \
                all(roles[u] == MB and phase[u] == "B" for u in users):
            phase[i] = "B"
            for o in jaxpr.eqns[i].outvars:
                vphase[o] = "B"


def _cuts(jaxpr, marks, backward: bool) -> dict:
    """eqn index -> cut index. A per-rank program's marks carry their cut (one mark per
    operand, compiler/pipeline_submesh.py); a user's k-th forward mark is cut k, its
    backward images come in reverse order."""
    if marks and all(jaxpr.eqns[e].params.get("cut") is not None for e in marks):
        return {e: jaxpr.eqns[e].params["cut"] for e in marks}
    n = len(marks)
    return {e: (n - 1 - k if backward else k) for k, e in enumerate(marks)}


def _split_zero_bubble(an) -> None:
    jaxpr = an.jaxpr.jaxpr
    outs = set(jaxpr.outvars)
    for k, sp_ in enumerate(an.stages):
        bset = set(sp_.backward)
        targets_i = set(an.bwd_send.get(k, []))
        targets_w = {o for i in sp_.backward for o in jaxpr.eqns[i].outvars if an.kind.get(o) == "acc" or o in outs}
        sp_.backward_input = _closure(targets_i, bset, an.producer, jaxpr)
        sp_.backward_weight = _closure(targets_w, bset, an.producer, jaxpr)


def _nbytes(a) -> int:
    return int(np.prod(a.aval.shape)) * a.aval.dtype.itemsize


def crossing_bytes(an) -> list:
    """Per forward op ``n`` of a one-stage analysis (``an.stages[0].forward``), the bytes of
    the forward values made up to ``n`` and read after it: what a cut after ``n`` sends on."""
    jaxpr = an.jaxpr.jaxpr
    fops = list(an.stages[0].forward)
    pos = {i: n for n, i in enumerate(fops)}
    diff = np.zeros(len(fops) + 1)
    for i in fops:
        for o in jaxpr.eqns[i].outvars:
            uses = [pos[u] for u in _users(jaxpr, o) if u in pos]
            if uses and max(uses) > pos[i]:
                diff[pos[i]] += _nbytes(o)
                diff[max(uses)] -= _nbytes(o)
    return [float(x) for x in np.cumsum(diff)[:-1]]


def _op_layers(an):
    """(eqn index -> the forward op position ("layer") it runs with when every forward op
    is a layer, per forward op whether a cut after it is forbidden), by ``auto_stages``'
    rules: a forward op is its own layer; a backward op runs with the latest forward value
    it reads, else the earliest backward value; a once op with the accumulated values it
    reads (the earliest, when it combines several). A stage is a range of layers, so these
    rules give every op the stage of its layer, and a cut is forbidden where a backward
    value would have to flow up the stages."""
    jaxpr = an.jaxpr.jaxpr
    fops, bops = list(an.stages[0].forward), list(an.stages[0].backward)
    layer, vl, vph = {}, {}, {}
    for n, i in enumerate(fops):
        layer[i] = n
        for o in jaxpr.eqns[i].outvars:
            vl[o], vph[o] = n, "F"
    last = max(len(fops) - 1, 0)
    # a cut after forward op c with lb <= c < k, for a backward op on layer k reading a backward
    # value of layer lb, would send that value up the stages (auto_stages' error): forbidden
    forbid = np.zeros(len(fops) + 1, dtype=np.int64)
    for i in bops:
        ins = [a for a in jaxpr.eqns[i].invars if not isinstance(a, jcore.Literal) and a in vl]
        fin = [vl[a] for a in ins if vph[a] == "F"]
        bin_ = [vl[a] for a in ins if vph[a] == "B"]
        layer[i] = max(fin) if fin else min(bin_) if bin_ else last
        for lb in bin_:
            if lb < layer[i]:
                forbid[lb] += 1
                forbid[layer[i]] -= 1
        for o in jaxpr.eqns[i].outvars:
            vl[o], vph[o] = layer[i], "B"
    for i, e in enumerate(jaxpr.eqns):
        if an.roles[i] == ONCE:
            ins = [vl[a] for a in e.invars if not isinstance(a, jcore.Literal) and a in vl]
            layer[i] = min(ins) if ins else last
            for o in e.outvars:
                vl[o], vph[o] = layer[i], "O"
    return layer, np.cumsum(forbid)[:-1] > 0


def layer_costs(an, op_time, *, rows: int, global_op_time=None, row_ratio: float = 1.0):
    """The search's ``LayerCosts`` (``passes/pipeline/search.py``) of a one-stage analysis
    (``analyse(..., S=1, auto=True)``) whose every forward op is a layer, priced by
    ``op_time(eqn)`` (one device's seconds on the traced micro-batch of ``rows`` rows):

    - forward / backward / update seconds of the ops each layer runs (``_op_layers``); with
      ``global_op_time`` (the same equation in a trace ``row_ratio`` times larger) the part
      that does not grow with the rows (a weight's bytes) is the fixed part;
    - state: every input that is not the batch (parameters, optimizer state) on the layer
      of its first reader, plus the gradient accumulators (also the bytes dp all-reduces);
    - activations: the forward values a backward op reads, on their producer's layer;
    - exchanges: ``crossing_bytes``, inf (no cut) where a backward value would flow up."""
    from ..passes.pipeline.search import LayerCosts
    jaxpr = an.jaxpr.jaxpr
    fops = list(an.stages[0].forward)
    L = len(fops)
    layer, forbidden = _op_layers(an)
    fwd, bwd, upd = [0.0] * L, [0.0] * L, [0.0] * L
    fwd_fix, bwd_fix = [0.0] * L, [0.0] * L
    state, grads, act = [0.0] * L, [0.0] * L, [0.0] * L
    fset, counted = set(fops), set()
    for i, k in layer.items():
        e = jaxpr.eqns[i]
        t = op_time(e)
        fixed = 0.0
        if global_op_time is not None and row_ratio > 1:
            # t(r) = fixed + slope * r through the two traces' sizes
            fixed = min(max((t * row_ratio - global_op_time(i)) / (row_ratio - 1), 0.0), t)
        if i in fset:
            fwd[k] += t
            fwd_fix[k] += fixed
        elif an.roles[i] == ONCE:
            upd[k] += t
        else:
            bwd[k] += t
            bwd_fix[k] += fixed
            for a in e.invars:
                if not isinstance(a, jcore.Literal) and an.producer.get(a) in fset and a not in counted:
                    counted.add(a)
                    act[layer[an.producer[a]]] += _nbytes(a)
            for o in e.outvars:
                if an.kind.get(o) == "acc":
                    grads[k] += _nbytes(o)
    # an input's layer: its first reader's, through the float ops made from it
    readers_layer = {}
    for i in reversed(range(len(jaxpr.eqns))):
        e = jaxpr.eqns[i]
        k = layer.get(i)
        if k is None:
            ks = [readers_layer[o] for o in e.outvars if o in readers_layer]
            k = min(ks) if ks else None
        if k is None:
            continue
        for a in e.invars:
            if not isinstance(a, jcore.Literal):
                readers_layer[a] = min(readers_layer.get(a, k), k)
    for v in jaxpr.invars:
        if an.bdim.get(v) is not None or v not in readers_layer:     # the batch is not state
            continue
        state[readers_layer[v]] += _nbytes(v)
    exchange = [math.inf if no else x for x, no in zip(crossing_bytes(an)[:-1], forbidden[:-1])]
    return LayerCosts(forward_s=fwd, backward_s=bwd, state_bytes=[s + g for s, g in zip(state, grads)],
                      activation_bytes=act, exchange_bytes=exchange,
                      grad_bytes=grads, update_s=upd, forward_fixed_s=fwd_fix, backward_fixed_s=bwd_fix,
                      rows=max(1, int(rows)))


def auto_stages(an, *, p: int, v: int, bounds) -> Analysis:
    """Cut a one-stage analysis (``analyse(..., S=1, auto=True)``) into ``p * v`` model
    stages without marks: ``bounds[k] = (a, b)`` gives model stage ``k`` the forward ops
    ``a..b-1`` (positions in ``an.stages[0].forward``; chosen by the pipeline search over
    ``layer_costs``, or from layer counts by ``layer_bounds``). A backward op runs on the
    stage of the forward values it reads (the highest), or, when it reads none, on the
    lowest stage of its backward inputs; backward values must flow down the stages (else a
    ShardingError asks for marks). Every value a later stage reads crosses each cut in
    between (relayed by the stages in between), so the exchanges are
    ``fwd_send``/``bwd_send`` sets rather than mark operands."""
    jaxpr = an.jaxpr.jaxpr
    S = p * v
    fops = list(an.stages[0].forward)
    bops = list(an.stages[0].backward)
    if len(fops) < S:
        raise ShardingError(f"automatic cuts: the forward has {len(fops)} ops for {S} stages; mark the cuts with "
                            "sp.stage_boundary")
    bounds = tuple((int(a), int(b)) for a, b in bounds)
    if len(bounds) != S or bounds[0][0] != 0 or bounds[-1][1] != len(fops) or \
            any(b0 != a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:])) or any(a >= b for a, b in bounds):
        raise ShardingError(f"automatic cuts: {bounds} is not {S} non-empty contiguous ranges of the "
                            f"{len(fops)} forward ops")
    pos = {i: n for n, i in enumerate(fops)}
    st_of = {}
    for k, (a, b) in enumerate(bounds):
        for n in range(a, b):
            st_of[fops[n]] = k
    vst, vph = dict(), dict()
    for i in fops:
        for o in jaxpr.eqns[i].outvars:
            vst[o], vph[o] = st_of[i], "F"
    for i in bops:
        ins = [a for a in jaxpr.eqns[i].invars if not isinstance(a, jcore.Literal) and a in vst]
        fin = [vst[a] for a in ins if vph[a] == "F"]
        bin_ = [vst[a] for a in ins if vph[a] == "B"]
        k = max(fin) if fin else min(bin_) if bin_ else S - 1
        if any(b < k for b in bin_):
            raise _err(f"automatic cuts: a backward value would flow up the stages here (forward inputs on stages "
                       f"{fin}, backward inputs on stages {bin_})", jaxpr.eqns[i],
                       "mark the cuts with sp.stage_boundary")
        st_of[i] = k
        for o in jaxpr.eqns[i].outvars:
            vst[o], vph[o] = k, "B"
    stages = [StageProgram() for _ in range(S)]
    for i in fops:
        stages[st_of[i]].forward.append(i)
    for i in bops:
        stages[st_of[i]].backward.append(i)
    stage = list(an.stage)
    for i, k in st_of.items():
        stage[i] = k
    var_stage = dict(an.var_stage)
    var_stage.update(vst)
    # once ops: on the stage of their accumulated inputs, or replicated when they combine stages
    rep_once = []
    for i, e in enumerate(jaxpr.eqns):
        if an.roles[i] != ONCE:
            continue
        sts = {var_stage[a] for a in e.invars if not isinstance(a, jcore.Literal)
               and an.kind.get(a) in ("acc", ONCE)} - {REP}
        stage[i] = sts.pop() if len(sts) == 1 else REP
        for o in e.outvars:
            var_stage[o] = stage[i]
        if stage[i] == REP:
            rep_once.append(i)
        else:
            stages[stage[i]].once.append(i)
    out = Analysis(an.jaxpr, an.global_jaxpr, an.literal_override, an.const_override, S, an.roles, stage,
                   [None if k is None else ("F" if i in pos else "B" if i in set(bops) else None)
                    for i, k in enumerate(stage)], stages, [], an.bwd_marks, an.bdim, an.kind, var_stage,
                   an.producer, an.training, rep_once)
    # what crosses each cut: forward values read on a later stage, backward values read on an earlier one
    for k in range(S - 1):
        fwd, bwd = [], []
        for i in fops + bops:
            for o in jaxpr.eqns[i].outvars:
                users = [st_of[u] for u in _users(jaxpr, o) if u in st_of]
                if vph[o] == "F" and st_of[i] <= k and any(u > k for u in users):
                    fwd.append(o)
                if vph[o] == "B" and st_of[i] > k and any(u <= k for u in users):
                    bwd.append(o)
        out.fwd_send[k], out.fwd_recv[k + 1] = fwd, fwd
        if an.training:
            out.bwd_send[k + 1], out.bwd_recv[k] = bwd, bwd
    out.cuts = bounds
    _split_zero_bubble(out)
    return out


_USERS: list = []     # (jaxpr, var -> reader eqn indices) of the last few jaxprs (a Jaxpr takes no attributes)


def _users(jaxpr, var):
    for j, cache in _USERS:
        if j is jaxpr:
            return cache.get(var, [])
    cache = {}
    for i, e in enumerate(jaxpr.eqns):
        for a in e.invars:
            if not isinstance(a, jcore.Literal):
                cache.setdefault(a, []).append(i)
    _USERS.insert(0, (jaxpr, cache))
    del _USERS[4:]
    return cache.get(var, [])


def _closure(targets, allowed: set, producer: dict, jaxpr) -> list:
    need, stack = set(), [t for t in targets if t in producer and producer[t] in allowed]
    while stack:
        i = producer[stack.pop()]
        if i in need:
            continue
        need.add(i)
        for a in jaxpr.eqns[i].invars:
            if not isinstance(a, jcore.Literal) and a in producer and producer[a] in allowed:
                stack.append(a)
    return sorted(need)


def _token(eqn, line: Optional[str]) -> tuple:
    """Equal ops, equal token: the primitive, its source ``line``, its operands' and
    results' shapes and dtypes (one layer of a Python loop traces to the same tokens each
    time)."""
    shapes = lambda vs: tuple((tuple(getattr(v.aval, "shape", ())), str(getattr(v.aval, "dtype", "")))  # noqa: E731
                              for v in vs)
    return (eqn.primitive.name, line, shapes(eqn.invars), shapes(eqn.outvars))


def _lines(eqns) -> list:
    """Each equation's source line; one jax left without a traceback (seen on one layer's
    ``* g`` of five alike, under grad) takes the line of the equation before it, so that
    its layer's tokens still repeat."""
    out, last = [], None
    for e in eqns:
        last = _src(e) or last
        out.append(last)
    return out


def model_layers(an, layers: Optional[int] = None):
    """The repeated block of a one-stage analysis' forward: ``(start, period, count)`` in
    forward op positions (``ir/repeats.py`` ``find_repeats`` over the ops' tokens: the run
    that covers the most ops), or None when nothing repeats.

    With ``layers`` (the count the user gave), where that run has fewer repeats: the run
    widened to ``layers`` blocks, or to as many as it widens to (``_widen``). The model's
    first and last layers meet its input and its head, and one of their ops can differ
    from the others' in its token (another source line, an input of another width),
    which cuts the exact run short by a block."""
    from ..ir.repeats import find_repeats
    jaxpr = an.jaxpr.jaxpr
    ids: dict = {}
    forward = [jaxpr.eqns[i] for i in an.stages[0].forward]
    seq = [ids.setdefault(_token(e, line), len(ids)) for e, line in zip(forward, _lines(forward))]
    runs = find_repeats(seq, min_saved=1)
    if not runs:
        return None
    r = max(runs, key=lambda r: (r.period * r.count, -r.start))
    if layers is not None and layers > r.count:
        kinds = [(e.primitive.name, len(e.invars), len(e.outvars)) for e in forward]
        for n in range(layers, r.count, -1):
            widened = _widen(seq, kinds, r.start, r.period, r.count, n)
            if widened is not None:
                return widened
    return r.start, r.period, r.count


def _widen(seq, kinds, start, period: int, count: int, want: int):
    """``(start, period, want)``: ``want`` blocks of ``period`` ops around the exact run
    ``seq[start : start + period * count]`` in which every op has the primitive (and
    arity, ``kinds``) of the run's op at its place in the block, its token differing the
    fewest times from the run's (ties: the start nearest the run's); None where no
    window of ``want`` blocks has the block's primitives throughout. The window may
    start up to a block before or after the run's start (an op that differs at the run's
    first or last place shifts the exact run's phase)."""
    best = None
    extra = want - count
    for s in range(start - extra * period, start + period):
        if s < 0 or s + want * period > len(seq):
            continue
        misses = 0
        for i in range(want * period):
            ref = start + (s - start + i) % period
            if kinds[s + i] != kinds[ref]:
                break
            misses += seq[s + i] != seq[ref]
        else:
            key = (misses, abs(s - start))
            if best is None or key < best[0]:
                best = (key, s)
    return None if best is None else (best[1], period, want)


def layer_bounds(an, counts) -> tuple:
    """``sp.Pipeline(stages=(n0, n1, ...))``: model stage ``k`` gets ``counts[k]`` layers of
    the model's repeated block (``model_layers``), in order; what comes before the block
    (an embedding) runs on the first stage and what follows it (the head, the loss) on the
    last. Returns per model stage its (first, end) forward op position."""
    counts = tuple(counts)
    found = model_layers(an, sum(counts))
    F = len(an.stages[0].forward)
    if found is None:
        raise ShardingError(f"Pipeline(stages={counts}): stages given per layer need the model's repeated layers, "
                            f"and no op sequence repeats in the step's forward ({F} ops): mark the cuts with "
                            "h = sp.stage_boundary(h) instead")
    start, period, count = found
    if sum(counts) != count:
        raise ShardingError(f"Pipeline(stages={counts}): the counts sum to {sum(counts)}, and the model has {count} "
                            f"layers (a block of {period} forward ops, {count} times); give layer counts "
                            f"that sum to {count}")
    edges, n = [0], 0
    for c in counts[:-1]:
        n += c
        edges.append(start + n * period)
    edges.append(F)
    # a cut between two layers can be one auto_stages refuses: a layer whose input its own
    # backward reads (a gated layer, x * sigmoid(x @ w)) runs that backward op with the
    # input's producer, the previous layer, and its result would flow up the stages. Such
    # a cut moves to the nearest op where it would not (ties: later), inside the layers
    # around it; nowhere, it stays and auto_stages' error says so
    forbidden = _op_layers(an)[1]
    for k in range(1, len(edges) - 1):
        e = edges[k]
        if 0 < e <= len(forbidden) and forbidden[e - 1]:
            near = sorted((abs(x - e), -x) for x in range(max(edges[k - 1] + 1, e - period + 1),
                                                          min(edges[k + 1], e + period))
                          if not forbidden[x - 1])
            if near:
                edges[k] = -near[0][1]
    bounds = tuple(zip(edges[:-1], edges[1:]))
    empty = [k for k, (a, b) in enumerate(bounds) if a >= b]
    if empty:
        raise ShardingError(f"Pipeline(stages={counts}): model stage {empty[0]} would run no op (0 layers and "
                            "nothing before or after the repeated layers); give every stage at least one layer")
    return bounds


def merge_layers(costs, cuts):
    """``LayerCosts`` whose layers are the ranges between ``cuts`` (cut after layer ``n``,
    sorted): sums of their times and bytes, the exchange of each kept cut. Returns it and
    each merged layer's first original layer."""
    from ..passes.pipeline.search import LayerCosts
    starts = [0] + [n + 1 for n in cuts]
    ends = starts[1:] + [costs.layers]
    part = lambda xs: [sum(xs[a:b]) for a, b in zip(starts, ends)]   # noqa: E731
    merged = LayerCosts(**{name: part(getattr(costs, name)) for name in (
        "forward_s", "backward_s", "state_bytes", "activation_bytes", "grad_bytes", "update_s",
        "forward_fixed_s", "backward_fixed_s")}, exchange_bytes=[costs.exchange_bytes[n] for n in cuts],
        rows=costs.rows)
    return merged, starts


