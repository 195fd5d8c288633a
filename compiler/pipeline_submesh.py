"""A pipelined step planned on the mesh axes beside the pipeline's (tensor parallel, ZeRO).

On a mesh such as ``((4, 2), ("pp", "mp"))`` every stage's work runs tensor parallel over
``mp``. The step is planned ONCE by the non-pipeline passes (bind the ``sp.shard`` marks,
propagate, insert reshards, collectives, localize) on the **sub-mesh** of the other axes,
so every value has one layout and the per-rank program holds its own collectives; that
per-rank program, as a jaxpr, is what the pipeline analysis (``compiler/pipeline_assign.py``)
cuts into stages and the lowering (``runtime/pipeline_lower.py``) runs inside one
``shard_map`` with every mesh axis manual.

The stage marks must survive planning: the importer treats ``stage_boundary`` as an
identity, so before import each mark becomes one ``copy_p`` per operand under a named
scope that records its direction and cut (:func:`marks_as_copies`); after planning the
replay binds those copies back as ``stage_boundary`` equations with a ``cut`` parameter
(:func:`per_rank_jaxpr`). A value crossing a cut is the copy's operand on one side and
its result on the other, and a copy has one layout in and out: both stages see the same
layout.

The step traced on a micro-batch (the program the stages run) chooses its strategies
(propagation, or with ``mode="auto"`` the search), and the traces at the other batch
sizes take them op by op (:class:`ReplaySearchedPlan`), so the plans the pipeline
compares agree by construction.
Under ``memory_limit`` that search is given a budget (``plan_submesh(memory_limit=)``):
what the pipeline leaves of the limit once it has kept its micro-batches in flight and
its accumulator (``compiler/pipeline_step.py`` ``PipelineFunction._fit_submesh``).

Pins: the batch leaves split on dim 0 over ``"dp"`` (when the sub-mesh has it); with
ZeRO-1 (``shard_optimizer_state``) the optimizer state in its parameter's planned layout
with ``"dp"`` added (:func:`zero_pins`); every state output is tied to the layout of the input it replaces, so the new state
comes back in the layout the next step reads.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import jax
from jax._src import source_info_util
from jax._src.lax.lax import copy_p
from jax.extend import core as jcore

from ..ir.errors import ShardingError
from ..ir.graph import is_collective
from ..passes.insert_reshards import InsertReshards
from ..passes.reshard_to_collectives import ReshardToCollectives
from ..passes.sink_reductions import SinkReductions
from ..runtime.lower import partition_spec, run_op
from .jaxpr_import import import_jaxpr
from .pipeline import Options, default_passes, run_pipeline
from .pipeline_assign import bind_eqn
from .stages import stage_boundary_p
from .fsdp import storage_layout
from .state import leaf_indices, optimizer_state_pins, state_ties

TAG = "sp_stage_boundary"
# the scope of the equations of the plan's own collectives and local slices: a slice of a
# micro-batch's rows to this rank's block is a layout move, not a batch-mixing op
LAYOUT_MOVE = "sp_layout_move"
_TAG_RE = re.compile(TAG + r"\.(forward|backward)\.(\d+)")


def marks_as_copies(closed):
    """``closed`` (calls inlined) with every ``stage_boundary`` replaced by one ``copy_p``
    per operand, inside a named scope ``sp_stage_boundary.<direction>.<cut>``."""
    jaxpr = closed.jaxpr
    nf = sum(1 for e in jaxpr.eqns if e.primitive.name == "stage_boundary" and e.params["direction"] == "forward")

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]   # noqa: E731
        fk = bk = 0
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            if eqn.primitive.name == "stage_boundary":
                direction = eqn.params["direction"]
                if direction == "forward":
                    cut, fk = fk, fk + 1
                else:
                    cut, bk = nf - 1 - bk, bk + 1
                with source_info_util.user_context(eqn.source_info.traceback), \
                        jax.named_scope(f"{TAG}.{direction}.{cut}"):
                    outs = [copy_p.bind(x) for x in ins]
            else:
                outs = bind_eqn(eqn, ins)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(a) for a in jaxpr.outvars]
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return jax.make_jaxpr(run)(*avals)


def _mark_of(op):
    src = op.__dict__.get("_source")
    info = getattr(src, "info", None)
    if op.kind not in ("copy_p", "copy") or info is None:
        return None
    found = _TAG_RE.search(str(info.name_stack))
    return (found.group(1), int(found.group(2))) if found else None


@dataclass
class SubmeshProgram:
    """One planned per-rank program: the jaxpr the pipeline cuts, and the layouts of its
    inputs and outputs on the sub-mesh (``PartitionSpec`` per invar / outvar, global
    shapes), and the graph's constants (inputs after the user's leaves)."""
    jaxpr: object            # ClosedJaxpr, local shapes
    in_specs: list
    out_specs: list
    in_dims: list            # per invar: the mesh axes per dim (Layout.dims)
    out_dims: list
    global_out_shapes: list
    consts: list
    graph: object


def _imported(closed, names, ir_mesh, batch_mask, arg_leaves):
    """The step as a Graph on the sub-mesh: marks as tagged copies, batch pinned over dp."""
    graph = import_jaxpr(marks_as_copies(closed), ir_mesh, names, "pipelined_step")
    for op in graph.ops:
        mark = _mark_of(op)
        if mark is not None:
            op.pipeline_mark = mark
        # the equation's jax source info, for the per-rank program's equations (their lines
        # find the model's layers): a pass that puts an op's line into words (the search's,
        # under mode="auto") replaces Op.source's lookup, and its traceback, by the text
        op.jax_source_info = getattr(op.__dict__.get("_source"), "info", None)
    graph.count_mesh = False
    if "dp" in ir_mesh.axis_names:
        for i, (x, b) in enumerate(zip(arg_leaves, batch_mask)):
            if b:
                graph.pinned_inputs[i] = ("axes", (("dp",),) + ((),) * (len(x.shape) - 1))
    return graph


def zero_pins(closed, names, *, ir_mesh, batch_mask, arg_leaves, args_tree, out_shape, mode: str, zero_axes,
              optimizer_argnums=(1,), param_argnums=(0,), batch_argnums=()) -> dict:
    """ZeRO-1 beside tensor parallelism: input index -> layout, for the parameters and the
    optimizer state. The plan without ZeRO gives each parameter its layout (the marks' mp
    splits); the parameters keep it (not split over dp: ZeRO-1, not 3), and an
    optimizer-state leaf that mirrors a parameter (its path inside the optimizer state
    ends with the parameter's path, same shape: Adam's mu and nu) takes it with the
    ``zero_axes`` added on a free dim (``compiler/fsdp.py`` ``storage_layout``), so it is
    split over dp x mp; any other leaf is split on its first dim over dp where that
    divides (``optimizer_state_pins``). One set of pins for every batch size's plan."""
    args = jax.tree_util.tree_unflatten(args_tree, arg_leaves)
    plain = plan_submesh(closed, names, ir_mesh=ir_mesh, jax_mesh=None, batch_mask=batch_mask, arg_leaves=arg_leaves,
                         args_tree=args_tree, out_shape=out_shape, mode=mode, batch_argnums=batch_argnums).graph
    planned = {i: v.layout for i, v in enumerate(plain.inputs)}
    flat = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    inner = [jax.tree_util.keystr(kp[1:]) for kp, _ in flat]
    params = leaf_indices(args, param_argnums)
    pins = {q: planned[q].without_partial() for q in params}
    pins.update(optimizer_state_pins(args, optimizer_argnums, ir_mesh, tuple(zero_axes)))
    for i in leaf_indices(args, optimizer_argnums):
        shape = tuple(arg_leaves[i].shape)
        mirrors = [q for q in params if inner[i].endswith(inner[q]) and tuple(arg_leaves[q].shape) == shape]
        if mirrors and shape:
            q = max(mirrors, key=lambda q: len(inner[q]))
            pins[i] = storage_layout(planned[q].without_partial(), shape, ir_mesh, tuple(zero_axes))
    return pins


@dataclass
class SearchedPlan:
    """What the choosing pass (propagation, or ``mode="auto"``'s search) chose for one trace of the step, to be written into the
    traces at the other batch sizes (:class:`ReplaySearchedPlan`): the mesh arrangement it
    kept, every input's layout, and per op (program order) the primitive and the strategy's
    factors and passthrough."""
    mesh: object
    inputs: list
    ops: list


def searched_plan(graph) -> SearchedPlan:
    return SearchedPlan(graph.mesh, [v.layout for v in graph.inputs],
                        [(op.kind, op.strategy.factors, op.strategy.passthrough) for op in graph.ops])


class ReplaySearchedPlan:
    """A second batch size: the strategies chosen for the first trace (by propagation, or
    ``mode="auto"``'s search), written op by op into this one (the traces have the same
    equations), in place of choosing again. A pipeline runs one per-rank program for a
    micro-batch and reads the batch dims off the other traces, so the plans must agree;
    chosen apart, a choice priced by bytes can flip at other row counts."""
    name = "replay-searched-plan"

    def __init__(self, plan: SearchedPlan):
        self.plan = plan

    def __call__(self, graph):
        from ..passes.plan_core.context import RuleBook
        from ..passes.plan_core.write import SEARCHED, write_plan
        from .source_lines import source_of
        plan = self.plan
        if len(graph.ops) != len(plan.ops) or any(op.kind != k for op, (k, _, _) in zip(graph.ops, plan.ops)):
            raise ShardingError("internal: the traces of a pipelined step at two batch sizes imported to different "
                                "programs, so the plan chosen for one cannot be written into the other")
        graph.set_mesh(plan.mesh)
        book, placed = RuleBook(), []
        for op, (_, factors, passthrough) in zip(graph.ops, plan.ops):
            st = book.strategy(book(op), factors, passthrough)
            problems = st.problems(graph.mesh)
            if problems:
                src = op.__dict__.get("_source")
                raise ShardingError(
                    f"{op.kind} at {source_of(getattr(src, 'info', None)) if src is not None else '<unknown>'}: "
                    f"its strategy was chosen on a micro-batch, and at a larger batch its shapes "
                    f"{[tuple(v.type.shape) for v in op.inputs]} do not take it ({'; '.join(problems)}); use "
                    "another micro-batch count, or fix the layout there with an sp.shard mark")
            placed.append((op, st, SEARCHED, None, None))
        write_plan(graph, dict(enumerate(plan.inputs)), placed)
        return graph


# the pass that chooses every op's strategy: the search (mode="auto") or propagation
CHOOSERS = ("search-strategies", "propagate-sharding")


def _run_passes(graph, options: Options, replay: dict):
    """The non-pipeline passes. The first trace planned chooses its strategies (the search
    with ``mode="auto"``, else propagation) and its plan is kept in ``replay["plan"]``;
    every later one takes that plan (``ReplaySearchedPlan``): propagation prices moves by
    bytes too, so it can choose differently at another row count. A step with loop or
    cond bodies is planned at every size (the replay writes top-level ops only), and the
    pipeline then checks that the plans agree."""
    if replay is None or any(op.subgraphs for op in graph.ops):
        return run_pipeline(graph, options).graph
    passes = default_passes(options)
    choose = next(n for n, p in enumerate(passes) if p.name in CHOOSERS)
    first = "plan" not in replay
    passes[choose] = _Recorded(passes[choose], replay) if first else ReplaySearchedPlan(replay["plan"])
    # the passes after it choose by bytes and divisibility too (an all_reduce sunk past an op
    # whose result is smaller, an output's completion, a reshard's collectives: a
    # reduce_scatter where a larger batch's rows divide, a psum where a micro-batch's do
    # not); the first trace's choices hold at a multiple of its size
    choices = replay.setdefault("choices", {})
    for n, p in enumerate(passes):
        kept = choices.setdefault(p.name, [])
        if isinstance(p, SinkReductions):
            passes[n] = _SameSinks(kept=kept, first=first)
        elif isinstance(p, InsertReshards):
            passes[n] = _SameCompletions(p.allow_reduce_scatter, p.cost, kept=kept, first=first)
        elif isinstance(p, ReshardToCollectives):
            passes[n] = _SameSteps(p.allow_reduce_scatter, p.cost, kept=kept, first=first)
    return run_pipeline(graph, options, passes=passes).graph


class _Replaying:
    """Choices of a pass, made on the first trace of a step and kept in order (``first``),
    or given back in that order on a later trace, where the values they are for must
    stand where they stood (the same layouts)."""

    def __init__(self, *args, kept: list, first: bool):
        super().__init__(*args)
        self.kept, self.first, self.at = kept, first, 0

    def _choice(self, key, choose):
        if self.first:
            self.kept.append((key, choose()))
            return self.kept[-1][1]
        if self.at >= len(self.kept) or self.kept[self.at][0] != key:
            raise ShardingError(f"internal: the traces of a pipelined step at two batch sizes planned different "
                                f"redistributions ({self.name}, choice {self.at}), so the first one's choices cannot "
                                "be given to the other")
        self.at += 1
        return self.kept[self.at - 1][1]


class _SameSinks(_Replaying, SinkReductions):
    """sink-reductions, each all_reduce sunk past an op (or not) as on the first trace."""

    def worth_carrying(self, op, vals):
        return self._choice((op.kind, tuple(v.layout for v in vals)),
                            lambda: SinkReductions.worth_carrying(self, op, vals))


class _SameCompletions(_Replaying, InsertReshards):
    """insert-reshards, each partial output completed as on the first trace."""

    def output_layout(self, v, mesh):
        return self._choice(v.layout, lambda: InsertReshards.output_layout(self, v, mesh))


class _SameSteps(_Replaying, ReshardToCollectives):
    """reshard-to-collectives, each reshard written with the first trace's steps."""

    def steps(self, src, dst, mesh):
        return self._choice((src.layout, dst.layout), lambda: ReshardToCollectives.steps(self, src, dst, mesh))


class _Recorded:
    """A pass that keeps what it planned in ``into["plan"]`` (``searched_plan``)."""

    def __init__(self, inner, into: dict):
        self.inner, self.into, self.name = inner, into, inner.name

    def __call__(self, graph):
        graph = self.inner(graph)
        self.into["plan"] = searched_plan(graph)
        return graph


def plan_submesh(closed, names, *, ir_mesh, jax_mesh, batch_mask, arg_leaves, args_tree, out_shape,
                 mode: str = "sharding_propagation", pins=None, batch_argnums=(), cost=None,
                 replay: dict = None, memory_limit=None, in_branches: bool = False) -> SubmeshProgram:
    """Plan ``closed`` (the step traced at some batch size, calls inlined) on the sub-mesh
    and return its per-rank program. ``arg_leaves``/``args_tree``: the step's arguments
    (abstract), for the pins; ``out_shape``: its outputs' shapes (for the state ties);
    ``pins``: more input layouts (ZeRO-1's, :func:`zero_pins`); ``cost``: the cost model
    propagation prices its choices by (None: the default); ``replay``: one dict shared by
    the plans of one step's traces: with ``mode="auto"`` the first is searched, the others
    take its strategies (``_run_passes``); ``memory_limit``: with ``mode="auto"``, bytes per
    device the searched plan's modeled peak must fit (``passes/auto``'s ``NoPlanFits`` where none does); ``in_branches``: the
    program runs in a branch per rank (the SPMD lowering: ``_permute_by_gather``)."""
    args = jax.tree_util.tree_unflatten(args_tree, arg_leaves)
    graph = _imported(closed, names, ir_mesh, batch_mask, arg_leaves)
    graph.pinned_inputs.update(pins or {})
    state = [a for a in range(len(args)) if a not in batch_argnums]
    graph.tied_outputs = state_ties(args, state, out_shape)
    options = Options(mode=mode, memory_limit=memory_limit, **({} if cost is None else {"cost": cost}))
    graph = _run_passes(graph, options, replay)
    if jax_mesh is None:   # the plan only
        return SubmeshProgram(None, [], [], [], [], [], [], graph)
    return SubmeshProgram(per_rank_jaxpr(graph, jax_mesh, permute_by_gather=in_branches),
                          [partition_spec(v.layout) for v in graph.inputs],
                          [partition_spec(v.layout) for v in graph.outputs],
                          [tuple(v.layout.dims) for v in graph.inputs], [tuple(v.layout.dims) for v in graph.outputs],
                          [tuple(v.type.shape) for v in graph.outputs],
                          [v.const for v in graph.inputs[graph.num_user_inputs:]], graph)


def _permute_by_gather(x, axes: tuple, pairs):
    """A collective permute over the sub-mesh's ``axes`` (``pairs``: (source, destination)
    ranks, linear over ``axes``, every rank a destination once) as an all_gather of the
    blocks over ``axes`` and each rank's pick of its source's block. The SPMD lowering
    runs each stage's program in a branch of a ``lax.switch`` on the rank, and a
    ``ppermute`` there names every device of the whole mesh in its pairs: XLA's CPU
    runtime waited for all of them, the other stages' devices, in other branches, never
    came, and the step hung (pipeline fuzzer seed 20261222, draw 38: pp x dp x mp with
    ZeRO-1). An all_gather's groups are the stage's devices only. The pick is a select
    among static slices: no constant table, no broadcast, which the whole mesh's replay
    of this program would have to take."""
    source = dict((d, s) for s, d in pairs)
    n = len(source)
    if sorted(source) != list(range(n)):
        raise ShardingError(f"internal: a permute's pairs {pairs} are not a permutation of the sub-mesh's ranks")
    blocks = jax.lax.all_gather(x, axes, axis=0, tiled=False)
    cases = [jax.lax.index_in_dim(blocks, source[r], 0, keepdims=False) for r in range(n)]
    return jax.lax.select_n(jax.lax.axis_index(axes), *cases)


def per_rank_jaxpr(graph, jax_mesh, permute_by_gather: bool = False):
    """The localized graph replayed on local blocks inside a ``shard_map`` over the
    sub-mesh and traced: the body's jaxpr (local shapes, the plan's collectives, the
    stage marks back as ``stage_boundary`` equations with their ``cut``). Each op's
    equations carry the user's source line, for the pipeline analysis' errors; the
    collectives' equations are in the ``sp_layout_move`` scope."""
    axes = graph.mesh.axis_names

    def read(env, v):
        return v.literal if v.is_literal else env[v.id]

    def body(*local):
        env = {v.id: x for v, x in zip(graph.inputs, local)}
        for op in graph.ops:
            ins = [read(env, v) for v in op.inputs]
            info = getattr(op, "jax_source_info", None) or getattr(op.__dict__.get("_source"), "info", None)
            tb = getattr(info, "traceback", None)
            mark = getattr(op, "pipeline_mark", None)
            with source_info_util.user_context(tb), \
                    (jax.named_scope(LAYOUT_MOVE) if is_collective(op) else contextlib.nullcontext()):
                if mark is not None:
                    outs = stage_boundary_p.bind(*ins, direction=mark[0], cut=mark[1])
                elif permute_by_gather and op.kind == "permute":
                    outs = [_permute_by_gather(ins[0], tuple(axes), op.params["pairs"])]
                else:
                    outs = run_op(op, ins, axes)
            for v, x in zip(op.outputs, outs):
                env[v.id] = x
        return tuple(read(env, v) for v in graph.outputs)

    in_specs = tuple(partition_spec(v.layout) for v in graph.inputs)
    out_specs = tuple(partition_spec(v.layout) for v in graph.outputs)
    avals = [jax.ShapeDtypeStruct(tuple(v.type.shape), v.type.dtype) for v in graph.inputs]
    outer = jax.make_jaxpr(jax.shard_map(body, mesh=jax_mesh, in_specs=in_specs, out_specs=out_specs,
                                         check_vma=False))(*avals)
    smaps = [e for e in outer.jaxpr.eqns if e.primitive.name == "shard_map"]
    if len(smaps) != 1:
        raise ShardingError("internal: the per-rank program of a pipelined step did not trace to one shard_map")
    inner = smaps[0].params["jaxpr"]
    return jcore.ClosedJaxpr(inner, [])
