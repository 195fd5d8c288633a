"""The pass pipeline: Graph -> Graph, one named pass at a time, with an optional
verification after each pass and the text of the graph after each (the
``NN_<pass>.ir`` dump files)."""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

from ..ir.graph import Graph
from ..ir.printer import print_graph
from ..ir.verifier import verify
from ..passes.auto import SearchStrategies
from ..passes.auto.search import TIME_BUDGET
from ..passes.bind_strategies import BindUserStrategies
from ..passes.cost import DEFAULT_COST, CostModel
from ..passes.insert_reshards import InsertReshards
from ..passes.localize import Localize
from ..passes.propagate import PropagateSharding
from ..passes.reshard_to_collectives import ReshardToCollectives
from ..passes.sink_reductions import SinkReductions


@contextmanager
def gc_paused():
    """Compiling builds many small, long-lived objects (ops, values, layouts, memo
    keys); Python's cyclic collector would rescan them over and over (a third of
    the compile time of a 12-layer GPT step). Nothing made here is garbage until
    the compile ends, so collection waits until then."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class Options:
    mode: str = "sharding_propagation"
    fuse_reduce_scatter: bool = True   # False: MindSpore's all_reduce + slice
    cost: CostModel = DEFAULT_COST
    verify: bool = False
    memory_limit: Optional[int] = None   # mode="auto": bytes per device the plan's modeled peak must fit
    # mode="auto": when the search's time budget ends (time.perf_counter()), shared by the
    # searches of one compile (the memory check's rounds); None: each search its own budget
    search_deadline: Optional[float] = None
    # mode="auto" under a limit: seconds the searches of one compile may take in all
    search_seconds: float = TIME_BUDGET
    # mode="auto": write the hand plan of this label instead of searching (compiler/measure.py)
    pick_hand: Optional[str] = None
    compare_hands: bool = False   # mode="auto": the hand plans solved without a limit too (measure=True)


def default_passes(opts: Options) -> list:
    rs = opts.fuse_reduce_scatter
    # Propagation prices a partial's completion as a reduce_scatter in either form:
    # MindSpore's all_reduce + slice is how a redistribution is written out, not a
    # reason to choose another plan (so both forms plan alike, as MindSpore's dumps do).
    # MindSpore's form also settles op by op only (whole_round): the seed document's plan.
    # mode="auto": a solver picks every strategy (passes/auto); the passes after it are the same
    choose = SearchStrategies(opts.cost, opts.memory_limit, deadline=opts.search_deadline,
                              time_budget=opts.search_seconds,
                              pick=opts.pick_hand, compare_hands=opts.compare_hands) if opts.mode == "auto" else \
        PropagateSharding(opts.mode, opts.cost, True, whole_round=rs)
    return [BindUserStrategies(), choose, SinkReductions(),
            InsertReshards(rs, opts.cost), ReshardToCollectives(rs, opts.cost), Localize()]


@dataclass
class PipelineResult:
    graph: Graph
    texts: dict = field(default_factory=dict)     # "NN_<pass>.ir" -> text
    seconds: dict = field(default_factory=dict)   # pass name -> seconds


def run_pipeline(graph: Graph, opts: Options, keep_texts: bool = False, on_pass=None,
                 passes: Optional[list] = None) -> PipelineResult:
    """Run every pass (``passes``, default ``default_passes(opts)``); ``on_pass(name)`` is
    told as each starts (compile progress)."""
    res = PipelineResult(graph)
    if opts.verify:
        verify(graph, "import")
    if keep_texts:
        res.texts["00_import.ir"] = print_graph(graph, title="after import")
    for i, p in enumerate(default_passes(opts) if passes is None else passes, start=1):
        if on_pass is not None:
            on_pass(p.name)
        t0 = time.perf_counter()
        graph = p(graph)
        res.seconds[p.name] = time.perf_counter() - t0
        if opts.verify:
            verify(graph, p.name)
        if keep_texts:
            res.texts[f"{i:02d}_{p.name}.ir"] = print_graph(graph, title=f"after {p.name}")
    res.graph = graph
    return res
