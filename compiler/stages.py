"""Pipeline stage marks and the pipeline configuration (issue 26).

``sp.stage_boundary(x)`` is an identity on a pytree of arrays that marks a cut between
two pipeline stages. It binds one ``stage_boundary`` primitive (all the pytree's leaves
are its operands, so one mark is one equation) with a ``direction`` parameter:

- ``"forward"``: the mark the user wrote; everything downstream of the k-th forward
  mark belongs to stage k+1;
- its JVP marks the tangents with the same direction (a linear mark), and the
  transpose of that mark is the **backward image**: ``direction="backward"``, whose
  operands are the cotangents flowing from stage k+1 back into stage k.

So a traced ``value_and_grad`` step holds, for every cut, one forward and one backward
``stage_boundary`` equation, and they delimit every stage's forward and backward ops
(``compiler/pipeline_assign.py``). The primitive batches (``vmap``) to itself, lowers
to nothing (its operands are its results) and survives ``jit``; the non-pipelined
compiler imports it as an identity (``compiler/jaxpr_import.py`` ``IDENTITIES``).

``sp.Pipeline(microbatches=8, schedule="1f1b")`` configures ``sp.parallelize(...,
pipeline=...)``; :func:`check_pipeline` validates it against the mesh.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..ir.errors import ShardingError
from ..passes.pipeline.schedules import SCHEDULES

FORWARD_MARK, BACKWARD_MARK = "forward", "backward"
_FLIP = {FORWARD_MARK: BACKWARD_MARK, BACKWARD_MARK: FORWARD_MARK}
LOWERINGS = ("spmd", "mpmd")

stage_boundary_p = Primitive("stage_boundary")
stage_boundary_p.multiple_results = True
# ``cut``: the cut index, set only on the marks of a per-rank program (compiler/pipeline_submesh.py
# replays a planned graph, where one mark of several operands is one mark per operand)
stage_boundary_p.def_impl(lambda *xs, direction, cut=None: list(xs))
stage_boundary_p.def_abstract_eval(lambda *avals, direction, cut=None: list(avals))
mlir.register_lowering(stage_boundary_p, lambda ctx, *xs, direction, cut=None: list(xs))


def _jvp(primals, tangents, *, direction):
    outs = stage_boundary_p.bind(*primals, direction=direction)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return outs, stage_boundary_p.bind(*tangents, direction=direction)


def _transpose(cts, *args, direction):
    cts = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cts]
    return stage_boundary_p.bind(*cts, direction=_FLIP[direction])


def _transpose_wrapped(cts, *args, direction):
    # cotangents of Zero type come with the aval of the primal
    fixed = []
    for ct, a in zip(cts, args):
        if type(ct) is ad.Zero:
            fixed.append(ad.instantiate_zeros(ct))
        else:
            fixed.append(ct)
    return stage_boundary_p.bind(*fixed, direction=_FLIP[direction])


ad.primitive_jvps[stage_boundary_p] = _jvp
ad.primitive_transposes[stage_boundary_p] = _transpose_wrapped
batching.primitive_batchers[stage_boundary_p] = (
    lambda args, dims, *, direction: (stage_boundary_p.bind(*args, direction=direction), dims))


def stage_boundary(tree):
    """Mark a cut between two pipeline stages: returns ``tree`` unchanged (a pytree of
    arrays). Under ``sp.parallelize(..., pipeline=sp.Pipeline(...))`` the ops before the
    k-th mark (in program order) run on stage k and the ops after it on stage k+1; the
    marked values are what the two stages exchange. Outside a pipeline it is an identity."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    return jax.tree.unflatten(treedef, stage_boundary_p.bind(*leaves, direction=FORWARD_MARK))


@dataclass(frozen=True)
class Pipeline:
    """How ``sp.parallelize`` pipelines a step over the ``axis`` mesh axis.

    microbatches: how many micro-batches the batch arguments are split into (a sequential
        split of dim 0; it must divide the batch), or ``"auto"``.
    schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (with ``virtual_stages``),
        ``"zero_bubble"`` (ZB-H1) or ``"auto"``: with either ``"auto"`` the pair of least
        modeled step time (``PipelineFunction._search``: the simulator on the cost
        model's stage times).
    virtual_stages: chunks per stage for ``"interleaved"`` (model stage ``c*p + d`` runs
        on rank ``d``); the program then needs ``p*v - 1`` ``stage_boundary`` marks.
    stages: ``None`` or ``"auto"``: the marks decide; without any mark the compiler
        chooses the cuts, with the micro-batch count and the schedule when either is
        ``"auto"``, in one search (``passes/pipeline/search.py`` ``search_pipeline`` over
        the forward ops, ``PipelineFunction._search_cuts``). Or a tuple of layer counts
        ``(n0, n1, ...)``, one per model stage (``p * v`` of them): model stage ``k`` runs
        ``n_k`` layers of the model's repeated block, in order (the block found by
        ``ir/repeats.py``; what precedes it runs on the first stage, what follows on the
        last; ``compiler/pipeline_assign.py`` ``layer_bounds``).
    axis: the mesh axis that carries the stages.
    lowering: ``"spmd"`` (default): one SPMD program over the pipeline axis, a scan over
        the schedule's ticks (``runtime/pipeline_lower.py``); ``"mpmd"``: one jitted
        program per stage action on its rank's device, driven from Python along the same
        tick table, the stages' state at its own shapes (``runtime/pipeline_mpmd.py``;
        the pipeline axis alone).
    """
    microbatches: Union[int, str] = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stages: Union[None, str, tuple] = None
    axis: str = "pp"
    lowering: str = "spmd"

    def __post_init__(self):
        if self.lowering not in LOWERINGS:
            raise ShardingError(f"Pipeline(lowering={self.lowering!r}): one of {', '.join(map(repr, LOWERINGS))}")
        if self.microbatches != "auto" and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ShardingError(f"Pipeline(microbatches={self.microbatches!r}): give a positive number of "
                                "micro-batches or \"auto\"")
        if self.schedule not in SCHEDULES + ("auto",):
            raise ShardingError(f"Pipeline(schedule={self.schedule!r}): one of {', '.join(SCHEDULES)} or \"auto\"")
        if isinstance(self.stages, list):
            object.__setattr__(self, "stages", tuple(self.stages))
        if not (self.stages is None or self.stages == "auto" or (
                isinstance(self.stages, tuple) and self.stages
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.stages))):
            raise ShardingError(f"Pipeline(stages={self.stages!r}): give None or \"auto\" (the marks, or the "
                                "compiler's cuts without marks), or the number of layers of each model stage, e.g. "
                                "stages=(3, 2, 2, 1)")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ShardingError(f"Pipeline(virtual_stages={self.virtual_stages!r}): a positive integer")
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", "auto"):
            raise ShardingError(f"Pipeline(virtual_stages={self.virtual_stages}) needs schedule=\"interleaved\" "
                                f"(got {self.schedule!r})")


def check_pipeline(pipeline: Pipeline, axis_names, axis_sizes) -> int:
    """The number of pipeline ranks ``p``; a ShardingError for a mesh without
    ``pipeline.axis``. The other axes run each stage's work: ``"dp"`` alone splits every
    micro-batch over its devices (the accumulated partial sums are all-reduced over it);
    any other axis (tensor parallel marks) has the step planned on the axes beside the
    pipeline's (``compiler/pipeline_submesh.py``)."""
    names = tuple(axis_names)
    if pipeline.axis not in names:
        raise ShardingError(f"Pipeline(axis={pipeline.axis!r}): the mesh has axes {names}; name the pipeline "
                            f"axis, e.g. mesh=((4,), ({pipeline.axis!r},))")
    p = int(dict(zip(names, axis_sizes))[pipeline.axis])
    if p < 2:
        raise ShardingError(f"the pipeline axis {pipeline.axis!r} has size {p}: a pipeline needs at least 2 stages "
                            "(for one stage, use sp.parallelize without pipeline=)")
    return p
