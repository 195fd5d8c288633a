"""``parallelize``: a single-device JAX function in, an SPMD function out."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..ir.errors import ShardingError, sharding_error
from ..passes.auto import memo as search_memo
from ..passes.auto.search import TIME_BUDGET as SEARCH_TIME_BUDGET
from ..passes.cost import resolve_cost_model
from ..runtime.lower import lower, partition_spec
from ..runtime.mesh import resolve_mesh
from ..runtime.distributed import initialize as initialize_distributed
from ..runtime.placement import owned_ranks, place, writes_global_files
from ..runtime.plan_data import load_plan_data

from .annotate import caller_source, normalize_tensor_strategy
from .fsdp import apply_fsdp, planned_input_layouts
from . import measure as measuring
from .memory_check import MemoryRound, ModeledLimits, abstract_inputs, compiled_memory, does_not_fit
from .pipeline import Options, gc_paused, run_pipeline
from .plan import Plan
from .progress import CompileProgress
from .progress import enabled as progress_enabled
from .report import write_html
from .state import data_parallel_pins, leaf_indices, optimizer_state_pins, state_ties
from .trace import trace

MODES = ("sharding_propagation", "semi_auto", "data_parallel", "auto")


def _memory_limit(limit, mode: str):
    """Bytes per device for mode="auto": the user's (int or "16GiB"), else the device's memory
    where jax reports it (none on CPU devices)."""
    from ..passes.auto import parse_memory_limit
    if limit is not None and mode != "auto":
        raise ShardingError(f"memory_limit is for mode='auto' (the search keeps the plan under it); mode={mode!r} "
                            "does not search")
    parsed = parse_memory_limit(limit)
    if parsed is None and mode == "auto":
        try:
            stats = jax.devices()[0].memory_stats() or {}
        except Exception:   # a backend without memory stats (CPU)
            stats = {}
        parsed = stats.get("bytes_limit")
    return parsed


class _NoSplits(tuple):
    """``()`` where it meets an array: split counts with no entries (a rank-0 tensor's),
    kept a leaf of the strategy tree and checked against the array's rank like any."""


def _is_tensor_strategy(x) -> bool:
    if x is None or isinstance(x, (PartitionSpec, _NoSplits)):
        return True
    return isinstance(x, tuple) and all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in x) \
        and len(x) > 0


def _shapes_of(tree):
    """Each leaf's shape (its type name if it has none), for error messages."""
    return jax.tree_util.tree_map(
        lambda x: tuple(np.shape(x)) if hasattr(x, "shape") or np.isscalar(x) else type(x).__name__, tree)


def _scalar_strategies_as_specs(prefix, tree_value):
    """``()`` is both an empty container and a scalar's strategy (no dims to split);
    where it meets an array leaf it is the latter: split counts, so an array of rank 1 or
    more given ``()`` is an error, as with any split counts of the wrong length (it was
    read as PartitionSpec(), which replicates any rank, and accepted silently)."""
    if prefix == () and not isinstance(prefix, PartitionSpec) and jax.tree_util.treedef_is_leaf(
            jax.tree_util.tree_structure(tree_value)) and tree_value is not None:
        return _NoSplits()
    if isinstance(prefix, (tuple, list)) and not _is_tensor_strategy(prefix) \
            and isinstance(tree_value, (tuple, list)) and len(prefix) == len(tree_value):
        items = [_scalar_strategies_as_specs(p, v) for p, v in zip(prefix, tree_value)]
        return type(prefix)(*items) if hasattr(prefix, "_fields") else type(prefix)(items)  # a NamedTuple
    if isinstance(prefix, dict) and isinstance(tree_value, dict) and prefix.keys() == tree_value.keys():
        return {k: _scalar_strategies_as_specs(prefix[k], tree_value[k]) for k in prefix}
    return prefix


def _per_leaf(prefix, tree_value, what: str, *, whose: str, operator: str, source) -> list:
    """Broadcast a strategy prefix (like jit's in_shardings) over the leaves of ``tree_value``
    (the function's arguments or outputs, as ``whose`` says)."""
    prefix = _scalar_strategies_as_specs(prefix, tree_value)
    leaves, treedef = jax.tree_util.tree_flatten(prefix, is_leaf=_is_tensor_strategy)
    try:
        subtrees = treedef.flatten_up_to(tree_value)
    except (ValueError, TypeError):
        expected = _shapes_of(tree_value)
        raise sharding_error(f"{what} does not match the structure of the {whose}: the {whose} are {expected}",
                             operator=operator, source=source, shapes=expected, strategy=prefix,
                             fix=f"give {what} the structure of the {whose} (or a prefix of it), one strategy per "
                                 f"array; None leaves that one to the compiler") from None
    out = []
    for leaf, sub in zip(leaves, subtrees):
        out += [leaf] * len(jax.tree_util.tree_leaves(sub))
    return out


@dataclass
class Compiled:
    fn: Callable
    plan: Plan
    out_tree: Any
    consts: list
    in_shardings: list
    mesh: Any = None      # the jax mesh it runs on (its own, whatever mesh the caller has set)
    donated: tuple = ()


class ParallelFunction:
    """The result of ``parallelize``: call it with global arrays, get global arrays."""

    def __init__(self, fn, *, mesh, mode, in_strategy, out_strategy, dump_dir, fuse_reduce_scatter, cost_model,
                 donate_argnums, verify, batch_argnums=None, shard_optimizer_state=False, optimizer_argnums=(1,),
                 progress=None, memory_limit=None, shard_params=False, param_argnums=(0,), measure=False,
                 search_seconds=None):
        if mode not in MODES:
            raise ShardingError(f"mode={mode!r} is not one of {MODES}")
        initialize_distributed()   # join a multi-process run (launcher, mpirun, SLURM) before looking at devices
        self.fn = fn
        self.mesh_spec = resolve_mesh(mesh)
        self.measure = bool(measure)
        if measure:
            _check_measure(mode, self.mesh_spec, fn)
        self.mode = mode
        self.batch_argnums = batch_argnums
        self.shard_optimizer_state = shard_optimizer_state
        self.optimizer_argnums = tuple(optimizer_argnums)
        self.shard_params = shard_params
        self.param_argnums = tuple(param_argnums)
        self.options = Options(mode=mode if mode in ("semi_auto", "auto") else "sharding_propagation",
                               fuse_reduce_scatter=fuse_reduce_scatter, cost=resolve_cost_model(cost_model, self.mesh_spec.ir_mesh),
                               verify=verify, memory_limit=_memory_limit(memory_limit, mode),
                               compare_hands=bool(measure), search_seconds=_search_seconds(search_seconds))
        cluster_cap = getattr(getattr(self.options.cost, "cluster", None), "gpu", None)
        if mode == "auto" and memory_limit is None and cluster_cap is not None:   # a Cluster's GPUs hold this much
            self.options = replace(self.options, memory_limit=cluster_cap.memory_capacity_bytes)
        self.in_strategy = in_strategy
        self.out_strategy = out_strategy
        self.dump_dir = dump_dir
        self.donate_argnums = tuple(donate_argnums)
        self.progress = progress
        self._cache: dict = {}
        self._dumped = False
        self.__name__ = getattr(fn, "__name__", "parallel_fn")
        self.__doc__ = getattr(fn, "__doc__", None)

    # -- compile ----------------------------------------------------------------
    def _key(self, args, kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        # the threefry flag changes which bits a draw makes, and so the plan's random_bits
        return tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves), \
            bool(jax.config.jax_threefry_partitionable)

    def _state_pins(self, args, graph, out_shape) -> None:
        """Data-parallel and optimizer-sharding pins, and outputs tied to the inputs they replace."""
        state = set(self.donate_argnums)
        if self.mode == "data_parallel":
            batch = tuple(self.batch_argnums) if self.batch_argnums is not None else (len(args) - 1,)
            graph.pinned_inputs.update(data_parallel_pins(args, batch, graph.input_names, graph.mesh))
            state |= {a for a in range(len(args)) if a not in batch}
        if self.shard_params:   # FSDP: params and optimizer state come back in their stored layouts
            state |= set(self.param_argnums) | set(self.optimizer_argnums)
        elif self.shard_optimizer_state:
            axes = self._data_parallel_axes(self.shard_optimizer_state, graph.mesh)
            graph.pinned_inputs.update(optimizer_state_pins(args, self.optimizer_argnums, graph.mesh, axes))
            state |= set(self.optimizer_argnums)
        graph.tied_outputs = state_ties(args, sorted(a for a in state if a < len(args)), out_shape)
        graph.donated_inputs = frozenset(self._donated_leaves(args))   # the modeled peak counts their outputs in place

    def _data_parallel_axes(self, choice, mesh) -> tuple:
        """The axes ZeRO splits state over: those named, else "dp" on a named mesh, else every axis."""
        axes = choice if isinstance(choice, (tuple, str)) else (
            ("dp",) if self.mesh_spec.named and "dp" in mesh.axis_names else mesh.axis_names)
        return (axes,) if isinstance(axes, str) else tuple(axes)

    def _pins(self, args, kwargs, graph, out_tree):
        where = graph.call_source = caller_source()
        if self.in_strategy is not None:
            prefix = self.in_strategy
            if not isinstance(prefix, (tuple, list)) or _is_tensor_strategy(prefix):
                prefix = (prefix,)
            if len(prefix) != len(args):
                shapes = _shapes_of(tuple(args))
                raise sharding_error(f"in_strategy has {len(prefix)} entries but the function got {len(args)} "
                                     "positional arguments", operator=f"parallelize({graph.name})", source=where,
                                     shapes=shapes, strategy=self.in_strategy,
                                     fix="give one entry per positional argument, "
                                     "None for those the compiler should choose")
            for i, s in enumerate(_per_leaf(tuple(prefix), tuple(args), "in_strategy", whose="arguments",
                                         operator=f"parallelize({graph.name})", source=where)):
                if s is not None:
                    graph.pinned_inputs[i] = normalize_tensor_strategy(
                        s, operator=f"parallelize({graph.name})", source=where,
                        which=f"in_strategy for input {graph.input_names[i]}", strategy=self.in_strategy)
        if self.out_strategy is not None:
            outs = self.out_strategy
            n_out = len(graph.outputs)
            if _is_tensor_strategy(outs) and outs is not None:
                per = [outs] * n_out
            else:
                outputs = jax.tree_util.tree_unflatten(out_tree, [v.type for v in graph.outputs])
                if out_tree.num_nodes == 1 and isinstance(outs, (tuple, list)) and len(outs) == 1:
                    outs = outs[0]    # one entry per output, MindSpore style, for a function with one
                per = _per_leaf(outs, outputs, "out_strategy", whose="outputs", operator=f"parallelize({graph.name})",
                                source=where)
            for i, s in enumerate(per):
                if s is not None:
                    graph.pinned_outputs[i] = normalize_tensor_strategy(
                        s, operator=f"parallelize({graph.name})", source=where, which=f"out_strategy for output {i}",
                        strategy=self.out_strategy)

    def _compile(self, args, kwargs) -> Compiled:
        key = self._key(args, kwargs)
        if key in self._cache:
            return self._cache[key]
        with self._progress() as progress:
            return self._build(key, args, kwargs, progress)

    def _progress(self) -> CompileProgress:
        return CompileProgress(self.__name__, show=progress_enabled(self.progress))

    def _build(self, key, args, kwargs, progress: CompileProgress) -> Compiled:
        # (the searches of this compile share warm LP models and hand solves, and see none
        # of an earlier compile's: a plan does not depend on what was compiled before)
        with search_memo.one_compile():
            return self._build_once(key, args, kwargs, progress)

    def _build_once(self, key, args, kwargs, progress: CompileProgress) -> Compiled:
        options = self.options
        fit = options.mode == "auto" and options.memory_limit is not None and not self.mesh_spec.abstract
        if fit:   # one time budget for the search and the memory check's searches again
            options = replace(options, search_deadline=time.perf_counter() + options.search_seconds)
        compiled = self._plan_and_lower(args, kwargs, progress, options)
        if fit:
            compiled = self._fit_compiled(compiled, args, kwargs, progress, options)
        if self.measure:
            compiled = self._fastest(compiled, args, kwargs, progress, options)
        self._cache[key] = compiled
        if self.dump_dir and not self._dumped:
            progress.stage("writing dumps")
            plan = compiled.plan
            plan.dump(self.dump_dir, ranks=None if self.mesh_spec.abstract else
                      owned_ranks(plan.graph.mesh.size, self.mesh_spec.devices),
                      write_global=writes_global_files())
            self._dumped = True
        return compiled

    def _plan_and_lower(self, args, kwargs, progress: CompileProgress, options: Options) -> Compiled:
        with gc_paused():
            t0 = time.perf_counter()
            progress.stage("tracing")
            graph, out_tree = self._trace(args, kwargs)
            trace_s = time.perf_counter() - t0
            res = run_pipeline(graph, options, keep_texts=bool(self.dump_dir), on_pass=progress.stage)
        graph = res.graph
        plan = Plan(graph, res.texts, res.seconds, trace_s,
                    # (a budget of its own: the compile's deadline has passed by then)
                    regenerate_texts=lambda: run_pipeline(self._trace(args, kwargs)[0],
                                                          replace(options, search_deadline=None),
                                                          keep_texts=True).texts)
        if self.mesh_spec.abstract:   # planned for devices not here: nothing to lower
            return Compiled(None, plan, out_tree, [v.const for v in graph.inputs[graph.num_user_inputs:]], [])
        progress.stage("lowering")
        jmesh = self.mesh_spec.jax_mesh(graph.mesh)
        n_user = graph.num_user_inputs
        donate = self._donated_leaves(args) if self.donate_argnums else ()
        fn = lower(graph, jmesh, donate=donate)
        consts = [v.const for v in graph.inputs[n_user:]]
        in_shardings = [NamedSharding(jmesh, partition_spec(v.layout)) for v in graph.inputs]
        return Compiled(fn, plan, out_tree, consts, in_shardings, jmesh, donate)

    def _fit_compiled(self, compiled: Compiled, args, kwargs, progress: CompileProgress,
                      base: Options) -> Compiled:
        """mode="auto" under a memory limit: compile the plan and hold what XLA allocates
        per device to the limit; over it, search again under a lower modeled limit
        (``memory_check.ModeledLimits``). ``plan.cost`` gets every round."""
        limit = self.options.memory_limit
        limits, modeled, largest, hands, compared = ModeledLimits(limit), limit, [], [], []
        while True:
            if compiled is not None:
                hands = compiled.plan.cost.hand_plans or hands
                compared += compiled.plan.cost.hand_plans or []
                progress.stage("XLA compile (memory check)")
                used = _compiled_memory(compiled, args, kwargs)
                if used is None:                    # the backend reports nothing to check
                    return compiled
                limits.add(MemoryRound(modeled, compiled.plan.cost.peak_memory, used))
                largest = compiled.plan.cost.largest
                if used.total <= limit:
                    break
            else:
                limits.add(MemoryRound(modeled))
            modeled = limits.next()
            if modeled is None:
                # no searched plan fits once compiled: a hand plan the search compared with may
                # (the lower modeled limits are set by the search's own plans' overshoot)
                compiled = self._hand_that_fits(hands, args, kwargs, progress, base)
                if compiled is None:
                    raise does_not_fit(limit, limits.rounds, largest)
                compiled.plan.cost.memory_checks = tuple(limits.rounds)
                return compiled
            options = replace(base, memory_limit=modeled)
            try:
                compiled = self._plan_and_lower(args, kwargs, progress, options)
            except ShardingError:               # no plan models under this limit
                compiled = None
        if len(limits.rounds) > 1:
            # a lowered modeled limit held the hand plans too to the searched plan's overshoot,
            # though their own programs may compile under the user's limit (the 12-layer GPT
            # step on 4 x 2 at 0.9 of the free peak left out ZeRO-1, modeled at half the
            # searched plan's time): those of every round cheaper as written are tried
            cheaper = self._hand_that_fits(compared, args, kwargs, progress, base,
                                           below=compiled.plan.cost.written_time or compiled.plan.cost.step_time,
                                           why="the memory check lowered the modeled limit for the searched plan, "
                                               "and this hand plan, cheaper as written, fits once compiled")
            if cheaper is not None:
                cheaper.plan.cost.memory_checks = tuple(limits.rounds)
                return cheaper
        cost = compiled.plan.cost
        cost.memory_limit, cost.modeled_limit = limit, modeled
        cost.compiled_memory = used
        cost.memory_checks = tuple(limits.rounds)
        return compiled

    def _fastest(self, compiled: Compiled, args, kwargs, progress: CompileProgress, base: Options) -> Compiled:
        """measure=True (``compiler/measure.py``): the search's plan and the hand plans the
        model prices close to it, each compiled, those over the memory limit left out,
        timed in turns; the fastest is returned, every figure in ``plan.cost.measured``."""
        cost = compiled.plan.cost
        mine = cost.written_time or cost.step_time
        runs, left_out = [("search", compiled, mine)], []
        for h in measuring.candidates(cost.hand_plans, mine, self.options.memory_limit):
            c, why = self._hand_compiled(h, args, kwargs, progress, base)
            if c is None:
                left_out.append(measuring.Measured(h.label, h.written, None, why))
            else:
                runs.append((h.label, c, h.written))
        progress.stage(f"timing {len(runs)} plans")
        steps = []
        for _, c, _ in runs:
            steps.append((functools.partial(_call_in_mesh, c),
                          functools.partial(measuring.zero_inputs, _abstract_inputs(c, args, kwargs))))
        seconds = measuring.median_steps(steps)
        best = min(range(len(runs)), key=seconds.__getitem__)
        timed = [measuring.Measured(name, modeled, t, "kept" if i == best else "")
                 for i, ((name, _, modeled), t) in enumerate(zip(runs, seconds))]
        kept = runs[best][1]
        kept.plan.cost.measured = tuple(timed + left_out)
        if best:   # (the limit's rounds searched for the search's plan, not this one)
            kept.plan.cost.memory_checks = cost.memory_checks
        return kept

    def _hand_compiled(self, h, args, kwargs, progress: CompileProgress, base: Options) -> tuple:
        """(the hand plan ``h`` of the search's comparison planned and lowered, or None;
        why not): None where it cannot be planned, or its compiled peak is over the
        memory limit (``plan.cost.compiled_memory`` has it where checked)."""
        progress.stage(f"the hand plan {h.name}")
        try:
            c = self._plan_and_lower(args, kwargs, progress, replace(base, pick_hand=h.label, search_deadline=None))
        except ShardingError as e:
            return None, "not planned: " + str(e).splitlines()[0]
        limit = self.options.memory_limit
        if limit is None:
            return c, ""
        used = _compiled_memory(c, args, kwargs)
        if used is not None and used.total > limit:
            return None, f"compiled {used.total:,} bytes per device, over the limit {limit:,}"
        cost = c.plan.cost
        cost.memory_limit, cost.compiled_memory = limit, used
        return c, ""

    def _hand_that_fits(self, hands: list, args, kwargs, progress: CompileProgress, base: Options,
                        below: float = float("inf"),
                        why: str = "no searched plan fit the limit once compiled, and this hand plan does"):
        """The cheapest (as written) of the hand plans ``hands`` modeled under the memory
        limit and cheaper than ``below`` whose compiled peak is under it too (at most
        MEASURE_MAX tried), its status saying ``why``, or None."""
        for h in measuring.candidates(hands, float("inf"), self.options.memory_limit):
            if h.written >= below:
                break
            c, _ = self._hand_compiled(h, args, kwargs, progress, base)
            if c is not None:
                c.plan.cost.solver["status"] += f"; {why}"
                return c
        return None

    def _trace(self, args, kwargs):
        graph, out_tree = self._trace_pinned(args, kwargs)
        if self.shard_params:
            # FSDP: the plan without it says each parameter's layout at use; trace afresh
            # (the passes rewrite the graph) and store every state leaf split over dp
            planned = planned_input_layouts(graph, self.options)
            graph, out_tree = self._trace_pinned(args, kwargs)
            apply_fsdp(graph, planned, leaf_indices(args, self.param_argnums),
                         leaf_indices(args, self.optimizer_argnums),
                         self._data_parallel_axes(self.shard_params, graph.mesh))
        return graph, out_tree

    def _trace_pinned(self, args, kwargs):
        context = self.mesh_spec.trace_mesh() if self.mesh_spec.named else None
        graph, out_tree, out_shape = trace(self.fn, args, kwargs, self.mesh_spec.ir_mesh, context)
        graph.count_mesh = not self.mesh_spec.named
        self._state_pins(args, graph, out_shape)
        self._pins(args, kwargs, graph, out_tree)
        return graph, out_tree

    def _donated_leaves(self, args) -> tuple:
        out, i = [], 0
        for a, arg in enumerate(args):
            n = len(jax.tree_util.tree_leaves(arg))
            if a in self.donate_argnums:
                out += range(i, i + n)
            i += n
        return tuple(out)

    # -- public -----------------------------------------------------------------
    def plan(self, *args, **kwargs) -> Plan:
        """Compile without running and return the plan."""
        return self._compile(args, kwargs).plan

    def _flat_inputs(self, c: Compiled, args, kwargs) -> list:
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        donated = set(c.donated)
        return [place(x, s, i in donated) for i, (x, s) in enumerate(zip(list(leaves) + c.consts, c.in_shardings))]

    def input_shardings(self, *args, **kwargs):
        """The ``NamedSharding`` each argument leaf is fed in, as a pytree like the
        arguments: what an input pipeline needs to assemble global batches in place
        (``jax.make_array_from_process_local_data``) and a checkpoint to restore into."""
        self.mesh_spec.require_devices("input_shardings")
        c = self._compile(args, kwargs)
        n = len(jax.tree_util.tree_leaves((args, kwargs)))
        tree = jax.tree_util.tree_structure((args, kwargs))
        a, kw = jax.tree_util.tree_unflatten(tree, c.in_shardings[:n])
        return a if not kwargs else (a, kw)

    def lower(self, *args, **kwargs):
        """jax's ``Lowered`` for these arguments (``.compile()``, ``.as_text()``,
        ``.compile().memory_analysis()``): what XLA is given to run."""
        self.mesh_spec.require_devices("lowering the step")
        c = self._compile(args, kwargs)
        with jax.set_mesh(c.mesh):
            return c.fn.lower(*self._flat_inputs(c, args, kwargs))

    def __call__(self, *args, **kwargs):
        self.mesh_spec.require_devices(f"running {self.__name__}")
        key = self._key(args, kwargs)
        c = self._cache.get(key)
        if c is not None:
            return self._run(c, args, kwargs)
        with self._progress() as progress:   # the first call also waits for XLA's compile
            c = self._build(key, args, kwargs, progress)
            progress.stage("XLA compile and first run")
            return self._run(c, args, kwargs)

    def _run(self, c: Compiled, args, kwargs):
        # under the program's own mesh: a caller's mesh with Explicit axes set around the
        # call would otherwise clash with the one the program was lowered for
        with jax.set_mesh(c.mesh):
            outs = c.fn(*self._flat_inputs(c, args, kwargs))
        return jax.tree_util.tree_unflatten(c.out_tree, list(outs))


def parallelize(fn: Callable, *, mesh, mode: str = "sharding_propagation", in_strategy=None, out_strategy=None,
                dump_dir: Optional[str] = None, fuse_reduce_scatter: bool = True,
                cost_model=None, donate_argnums=(), verify: bool = False,
                batch_argnums=None, shard_optimizer_state=False, optimizer_argnums=(1,),
                progress: Optional[bool] = None, memory_limit=None, shard_params=False,
                param_argnums=(0,), pipeline=None, measure: bool = False,
                search_seconds: Optional[float] = None) -> ParallelFunction:
    """Make ``fn`` run SPMD on ``mesh``.

    mesh: a device count (the first N devices), a ``jax.sharding.Mesh``, or
        ``(shape, axis_names)`` such as ``((2, 4), ("dp", "mp"))``. A
        ``jax.sharding.AbstractMesh``, or ``(shape, axis_names)`` larger than the devices
        present, can be planned (``.plan`` on ``jax.ShapeDtypeStruct``s) but not run.
    mode: ``"sharding_propagation"`` (default) infers every unannotated op's
        strategy from its neighbours; ``"semi_auto"`` gives unannotated ops
        MindSpore's data-parallel default.
    in_strategy / out_strategy: optional layouts of the function's own inputs and
        outputs (one entry per positional argument / output, None = free).
    dump_dir: write the IR dumps there on first compile.
    fuse_reduce_scatter: False emits MindSpore's literal ``all_reduce`` + ``slice``
        where a ``reduce_scatter`` moves half the bytes.
    donate_argnums: state arguments (params, optimizer state) whose buffers the step
        may reuse; the matching outputs come back in the layouts the inputs had.
    mode="data_parallel": the ``batch_argnums`` (default: the last positional
        argument) are split on dim 0 over every device, everything else is
        replicated; gradients are all-reduced because the graph says so.
    shard_optimizer_state: ZeRO-1 / MindSpore's optimizer parallel: the
        ``optimizer_argnums`` state is split over the data-parallel axes (True:
        "dp" on a named mesh, else every axis; or name the axes), so gradients are
        reduce-scattered and updated parameters all-gathered.
    shard_params: FSDP / ZeRO-3: the ``param_argnums`` parameters and the
        ``optimizer_argnums`` state are stored split over the data-parallel axes (as
        ``shard_optimizer_state`` names them) on top of the layout the plan gives
        them; each parameter is all-gathered right before every op that computes with
        it, and its gradient is reduce-scattered (``compiler/fsdp.py``). Composes
        with tensor-parallel marks on a named mesh.
    cost_model: what propagation's choices are priced by: None (the default model), a
        ``CostModel`` (``CostModel.load(path)`` reads a ``shardprop calibrate``
        profile), the name of a built-in profile, ``"cpu"`` or ``"h100"``, or an
        ``sp.Cluster`` (nodes of GPUs and their links; with mode="auto" its GPUs' memory
        is the default ``memory_limit``). A profile measured on another mesh is a
        ShardingError.
    mode="auto": a solver (HiGHS) picks every strategy that no mark, in/out
        strategy or returned state fixes, minimizing the modeled step time with
        the modeled peak bytes per device under ``memory_limit`` (an int, or text
        such as "12MB" or "16GiB"; default: the device's memory, none on CPU).
        Under a limit the plan is compiled and what XLA allocates per device
        (``memory_analysis()``: arguments + outputs + temp - aliased) is held to it,
        searching again under a lower modeled limit when it is over; no plan fits:
        a ShardingError with the figures. ``plan.cost`` and ``plan.explain()`` show
        what it chose and why (``plan.cost.compiled_memory``, ``memory_checks``).
    progress: a compile that takes over 2 s shows its stages on stderr (tracing,
        each pass, lowering, XLA's compile); False (or SHARDPROP_PROGRESS=0) keeps
        it quiet, True shows them as the default does.
    pipeline: ``sp.Pipeline(microbatches=..., schedule=...)`` pipelines the step over the
        mesh's ``pp`` axis (``compiler/pipeline_step.py``; docs/guide/pipeline.md): the
        ``batch_argnums`` are split into micro-batches, the stages are cut at
        ``sp.stage_boundary`` marks; returns a ``PipelineFunction``. Other mesh axes run
        each stage's work: ``mode`` ("sharding_propagation" or "semi_auto") plans the
        ``sp.shard`` marks on them, or ``"auto"`` searches their strategies (the marks
        kept); ``shard_optimizer_state`` is ZeRO-1 over ``dp``. ``mode="auto"`` on a mesh
        whose ``pp`` axis has more than one device pipelines the step without
        ``pipeline=``: as ``sp.Pipeline(microbatches="auto", schedule="auto")``, the cuts
        searched too where the step has no ``stage_boundary`` mark.
    measure: ``mode="auto"``: time the search's plan beside the hand plans (DP, ZeRO-1,
        FSDP, Megatron, tp+FSDP) that fit and that the model prices within 50% of it,
        each compiled and run a few steps on zeros, and keep the fastest
        (``compiler/measure.py``; ``plan.cost.measured``). For hardware the cost model
        describes poorly; it adds a compile and a few steps per plan timed.
    search_seconds: ``mode="auto"`` under a memory limit: the seconds its searches may take
        in all (default 20; the memory check's searches again included). When they run out
        it returns the best plan found that fits, with its proven gap (``plan.cost.solver``),
        or the best hand plan that fits; where none was found, a ShardingError says so.
    """
    implied = pipeline is None and mode == "auto" and _has_pipeline_axis(mesh, fn)
    if implied:
        # mode="auto" on a mesh with a "pp" axis: a pipeline whose cuts (without marks), micro-batch
        # count and schedule are searched, each stage's work planned by the search on the other axes
        from .stages import Pipeline
        pipeline = Pipeline(microbatches="auto", schedule="auto")
    if pipeline is not None:
        # what a pipelined step does not take yet is refused by name, never dropped
        # mode (of the marks' propagation, or the search, on the axes beside the pipeline's) and ZeRO-1 are taken
        given = {"mode": mode not in ("sharding_propagation", "semi_auto", "auto"),
                 "in_strategy": in_strategy is not None,
                 "out_strategy": out_strategy is not None, "fuse_reduce_scatter": not fuse_reduce_scatter,
                 "donate_argnums": bool(donate_argnums), "verify": verify,
                 "shard_params": bool(shard_params), "measure": bool(measure),
                 "search_seconds": search_seconds is not None}
        unsupported = [name for name, set_ in given.items() if set_]
        if unsupported:
            what = ("mode='auto' on a mesh with a 'pp' axis pipelines the step, and a pipelined step"
                    if implied else "parallelize(pipeline=...)")
            other = "on a mesh without a 'pp' axis" if implied else "without pipeline="
            raise sharding_error(f"{what} does not take {', '.join(unsupported)} yet",
                                 operator=f"parallelize({getattr(fn, '__name__', 'fn')})", source=caller_source(),
                                 shapes=None, strategy=pipeline,
                                 fix=f"drop {', '.join(unsupported)}, or parallelize {other}")
        from .pipeline_step import PipelineFunction
        return PipelineFunction(fn, mesh=mesh, pipeline=pipeline, batch_argnums=batch_argnums, dump_dir=dump_dir,
                                memory_limit=memory_limit, mode=mode, shard_optimizer_state=shard_optimizer_state,
                                optimizer_argnums=optimizer_argnums, cost_model=cost_model)
    return ParallelFunction(fn, mesh=mesh, mode=mode, in_strategy=in_strategy, out_strategy=out_strategy,
                            dump_dir=dump_dir, fuse_reduce_scatter=fuse_reduce_scatter, cost_model=cost_model,
                            donate_argnums=donate_argnums, verify=verify, batch_argnums=batch_argnums,
                            shard_optimizer_state=shard_optimizer_state, optimizer_argnums=optimizer_argnums,
                            progress=progress, memory_limit=memory_limit, shard_params=shard_params,
                            param_argnums=param_argnums, measure=measure, search_seconds=search_seconds)


def _search_seconds(seconds) -> float:
    """``parallelize``'s ``search_seconds``: a positive number of seconds (None: the default)."""
    if seconds is None:
        return SEARCH_TIME_BUDGET
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ShardingError(f"search_seconds={seconds!r}: give the seconds mode='auto' may search, a positive "
                            f"number (default {SEARCH_TIME_BUDGET:g})")
    return float(seconds)


def _abstract_inputs(c: Compiled, args, kwargs) -> list:
    """What ``c``'s program is called with, abstractly: the arguments' leaves and its
    constants, under its input shardings."""
    return abstract_inputs(list(jax.tree_util.tree_leaves((args, kwargs))) + c.consts, c.in_shardings)


def _compiled_memory(c: Compiled, args, kwargs):
    """What XLA allocates per device for ``c``'s program (``memory_check.compiled_memory``),
    compiled under its mesh as the call runs it, so the call reuses this compile."""
    with jax.set_mesh(c.mesh):
        return compiled_memory(c.fn, _abstract_inputs(c, args, kwargs))


def _call_in_mesh(c: Compiled, *inputs):
    with jax.set_mesh(c.mesh):
        return c.fn(*inputs)


def _check_measure(mode: str, spec, fn) -> None:
    """measure=True times compiled plans here: it needs mode="auto" (the plans to time are
    the search's and the hand plans it compared with), devices present, and one process
    (every process must run the same plan, and each would time its own)."""
    why = ("it times the search's plan against the hand plans, which only mode='auto' has" if mode != "auto" else
           "it runs the plans it times, and this mesh has devices that are not here" if spec.abstract else
           f"each of the {jax.process_count()} processes would time and keep its own plan"
           if jax.process_count() > 1 else None)
    if why:
        raise sharding_error(f"measure=True: {why}", operator=f"parallelize({getattr(fn, '__name__', 'fn')})",
                             source=caller_source(), shapes=None, strategy=f"mode={mode!r}",
                             fix="use mode='auto' on the devices of one process, or drop measure=True")


def _has_pipeline_axis(mesh, fn) -> bool:
    """Whether ``mesh`` (as ``parallelize`` takes it) has a ``"pp"`` axis of more than one
    device: the axis a pipeline's stages run on. A pipeline runs on the devices it is given;
    planned for absent ones (an abstract mesh) it is ``sp.plan_step``'s work."""
    initialize_distributed()   # as ParallelFunction does, before resolving asks jax for devices
    spec = resolve_mesh(mesh)
    sizes = dict(zip(spec.ir_mesh.axis_names, spec.ir_mesh.axis_sizes))
    if sizes.get("pp", 1) > 1 and spec.abstract:
        raise sharding_error(f"mode='auto' on the mesh {sizes} pipelines the step over its 'pp' axis, and a "
                             "pipelined step runs on devices that are here; this mesh has more devices than "
                             f"the {len(jax.devices())} present",
                             operator=f"parallelize({getattr(fn, '__name__', 'fn')})", source=caller_source(),
                             shapes=None, strategy=None,
                             fix="plan it for absent devices with sp.plan_step(step, args, mesh=..., mode='auto'), "
                                 "or use a mesh of the devices present")
    return sizes.get("pp", 1) > 1


def report(plan_or_dump_dir, path) -> str:
    """``sp.report(plan, "plan.html")`` or ``sp.report("saved_graph/", "plan.html")``:
    the plan report of a compiled plan or of a dump folder (its ``plan.json``).
    (compiler/report.py only renders plan data.)"""
    if isinstance(plan_or_dump_dir, Plan) or callable(getattr(plan_or_dump_dir, "to_html", None)):
        return plan_or_dump_dir.to_html(str(path))   # a Plan, or a pipelined step's PipelinePlan
    return write_html(load_plan_data(str(plan_or_dump_dir)), str(path))
