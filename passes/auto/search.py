"""Pass ``search-strategies`` (``mode="auto"``): every op's strategy from a solver.

Before: user marks, in/out strategies and returned state are bound (as for
propagation); other ops have nothing.
After: every op has an ``OpStrategy`` and every value a layout, as after
``propagate-sharding``, so the passes after it (sink-reductions, insert-reshards,
lowering, dumps) run unchanged. Loop and branch bodies are then planned by
propagation with their boundary pinned to the loop op's searched layouts.

How: build the problem (``problem.py``), reduce it and solve it (``milp.py``);
under a memory limit, solve, find the program point where the plan's modeled
live bytes peak, and if that is over the limit add that point's constraint and
solve again (the constraint is exact; only the points that bind are ever added);
the constraints' LP relaxation first, rounded, kept where proven near its bound.
On a device-count mesh with nothing pinned, every arrangement of the devices into
one or two axes is searched and the cheapest plan kept.
"""
from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

from ...ir.errors import ShardingError
from ...ir.graph import CONSTRAINT, Graph
from ...ir.mesh import Mesh

from ..cost import DEFAULT_COST, CostModel, trips
from ..loop_boundaries import boundary_layouts
from ..plan_core.evaluate import evaluate_written
from ..plan_core.pricing import Prices
from ..plan_core.write import SEARCHED, USER, follows, follows_input, user_fixed, write_plan
from ..propagate import PropagateSharding
from ..rules import FIXED
from . import hand, lagrange, memo, milp, warm_lp
from .memory import (copy_bytes, fused_bytes, largest_at_peak, plan_peak, plan_profile, program_facts,
                     view_bytes)
from .refine import refine
from .repair import fit_by_switching
from .problem import DECIDERS, Problem

MAX_MEMORY_ROUNDS = 25
# a graph of at most this many ops is also searched without coarsening (every op its own
# decision, no shared layers): the exact ILP solves such graphs in about a second, and
# the better of the two plans is kept
EXACT_OPS = 150
# seconds the search under a memory limit may take in all (every arrangement, every
# memory round); when they run out it returns the best plan found that fits (a hand
# plan where the rounds found none) with its proven gap
TIME_BUDGET = 20.0
# under a limit, the memory rows' LP relaxation is solved first and rounded; a rounded plan
# that fits and is proven within this fraction of the LP's bound is kept (the exact MILP
# with the rows took 7-20 s on the 2-layer GPT step where its LP takes about 1.5 s and its
# rounding was 0.3% above the MILP's optimum)
RELAXED_GAP = 0.05
# the Lagrange multipliers, where the exact rows ran out of time before any plan, stop when
# the budget is spent and they have a plan that fits, but may run until this long past its
# end to find one: a grace the searches of one compile share (``_multipliers_seconds``)
MULTIPLIERS_MIN_S = 10.0
# where a rounded LP plan fits but is not proven within RELAXED_GAP, the exact rows get
# this long, over all their rounds (a row where a plan of theirs overflows, then again),
# to prove that gap or find a cheaper plan (on the GPT steps of bench/auto.py at 12
# layers they ran the whole 20 s budget to the same plan, 4.8-6.9% from the bound)
EXACT_AFTER_ROUNDED_S = 3.0
# ... but only where the warm model's first, cold LP took under this share of that time:
# branch and bound starts from such a solve (with the rows, from scratch) and needs room to
# branch (``hand.BRANCH_ROOT_S``, the same rule for the hand families). On the GPT steps on
# 4 x 2 at 0.5 of the free peak (2, 4 and 12 layers: cold LPs of 0.4 s and more) the brief
# exact rows ran their 3 s out with no plan every time
EXACT_ROOT_SHARE = 0.1
# ... and first the Lagrange multipliers get at most this long, from the rows met so far:
# their solves are unlimited problems, which meet rows where plans overflow in a fraction
# of an exact solve with rows (on the 2-layer SGD MLP step of tests/test_auto.py at 0.7 of
# the free peak, un-coarsened: 4 of the rows the exact optimum needs in 8 solves, 0.1 s,
# where the exact rows met one row per 0.3-1.6 s solve and ran out of their 3 s)
MULTIPLIERS_BRIEF_S = 1.0
# LP diving (``_dive``) stops once the cheapest plan that fits it has met is within this
# fraction of its LP's bound: diving on cannot find one cheaper by more (on the 2-layer
# GPT step on 4 x 2 it had met a plan within 0.05% of its LP at its 7th of 12 solves,
# then ran out of time and returned none)
DIVE_STOP = 0.005
# ... and once it holds a plan proven within RELAXED_GAP (the plan the LP rounds keep) it goes
# on for at most this long (on the 2-layer GPT step, from a rounding 1.3% above the bound on
# 2 x 4 at 0.9 it found one 0.6% above in 1.1 s; from one 4.5% above on 4 x 2 at 0.7 it ran 11 s
# and found none cheaper)
DIVE_POLISH_S = 1.5
# ... and from a plan that fits outside RELAXED_GAP (``dive_far``) for at most this long: on the
# GPT steps on 4 x 2 at 0.5 such dives ran 5.5 s (2 layers), 7.8 s (4) and 14.3 s (12) to the
# budget's end and found none cheaper, where every dive that improved a plan did so within 1.3 s
DIVE_FAR_S = 2.0
# ... and at most this long for the first such dive, before the multipliers: on the GPT steps on
# 2 x 4 at 0.9 it met, in 0.08-0.15 s, the plan the multipliers' rows had led to (2, 4 and 12
# layers: 4.3 -> 2.7 s, 6.8 -> 4.0 s, 4.4 -> 3.2 s); on 4 x 2 at 0.5, where it meets nothing, it
# moved the rows the later rounds add (the searches took 0.8-2.7 s longer, to the same plans)
DIVE_FAR_FIRST_S = 0.5
# seconds a hand family whose time-optimal plan is over the limit gets to be made to fit it
# (``repair.py``; 0.06-0.23 s per family on the 2-layer GPT step on 4 x 2 at half the free peak)
HAND_FIT_S = 2.0


@dataclass
class Alternative:
    op: str                     # "dot_general at net.py:7"
    count: int                  # ops that share this decision (repeated layers)
    chosen: str                 # the chosen strategy, as split counts per operand
    chosen_time: float          # modeled step time of the plan
    rejected: Optional[str]     # the best other strategy for this decision
    rejected_time: Optional[float]   # the plan's modeled step time with it instead
    rejected_peak: Optional[float] = None   # its modeled peak bytes per device

    def __str__(self):
        head = f"{self.op}" + (f" (x{self.count}, one decision)" if self.count > 1 else "")
        line = f"{head}\n  chosen   {self.chosen}: step {self.chosen_time * 1e3:.4f} ms"
        if self.rejected is None:
            return line + "\n  (no other strategy)"
        worse = (self.rejected_time / self.chosen_time - 1) * 100 if self.chosen_time else 0.0
        return line + (f"\n  rejected {self.rejected}: step {self.rejected_time * 1e3:.4f} ms ({worse:+.1f}%)"
                       + (f", peak {self.rejected_peak / 2**20:.2f} MiB" if self.rejected_peak is not None else ""))


class NoPlanFits(ShardingError):
    """No plan fits the search's memory limit; ``smallest``: the least modeled peak per
    device it found (bytes), for a caller that sets the limit (a pipeline's stages)."""

    def __init__(self, message: str, smallest: float):
        super().__init__(message)
        self.smallest = smallest


@dataclass
class SearchResult:
    """What ``plan.cost`` shows: the modeled step of the chosen plan, per device."""
    step_time: float             # seconds (compute + communication)
    compute_time: float
    communication_time: float
    bytes_moved: float           # sent per device per step
    peak_memory: float           # modeled live peak, bytes per device
    flops: float                 # per device per step
    memory_limit: Optional[int]
    mesh: str
    solver: dict = field(default_factory=dict)      # status, seconds, gap, variables, ...
    breakdown: dict = field(default_factory=dict)   # op kind -> {compute, communication, bytes}
    decisions: list = field(default_factory=list)   # Alternative per matmul/conv decision
    largest: list = field(default_factory=list)     # (name, shape, bytes) of the largest values at the modeled peak
    modeled_limit: Optional[int] = None             # what the modeled peak was held to (memory_check may lower it)
    hand_plans: list = field(default_factory=list)  # hand.HandPlan: the hand plans compared with (explain lists them)
    # step_time as insert-reshards writes the plan (a copy several ops read, once), the top
    # level only, as the hand plans are priced (the loop bodies' moves are in step_time)
    written_time: Optional[float] = None
    compiled_memory: Any = None     # what XLA allocates per device (compiler/memory_check.py), where checked
    memory_checks: tuple = ()       # each plan compiled against the limit: modeled limit, peak, compiled
    measured: tuple = ()            # measure=True: compiler.measure.Measured per candidate timed

    def __str__(self):
        lines = [f"modeled step {self.step_time * 1e3:.4f} ms on {self.mesh} (compute {self.compute_time * 1e3:.4f} ms, "
                 f"communication {self.communication_time * 1e3:.4f} ms)",
                 f"bytes moved per device {self.bytes_moved:,.0f}; modeled peak per device {self.peak_memory:,.0f}"
                 + (f" (limit {self.memory_limit:,})" if self.memory_limit else "")
                 + f"; flops per device {self.flops:,.0f}"]
        if self.modeled_limit is not None and self.modeled_limit != self.memory_limit:
            lines.append(f"modeled peak held to {self.modeled_limit:,} (the limit less what XLA added)")
        if self.compiled_memory is not None:
            lines.append(f"compiled per device {self.compiled_memory}")
        if len(self.memory_checks) > 1:
            lines += [f"  memory round {k}: {r}" for k, r in enumerate(self.memory_checks, start=1)]
        if self.measured:
            lines.append("measured (measure=True: the fastest is kept):")
            lines += [f"  {m}" for m in self.measured]
        if self.hand_plans:
            lines.append("hand plans compared with (their storage layouts, each op's strategy solved for them; "
                         "modeled):")
            mine = self.written_time or self.step_time
            lines.append(f"  (as written, auto's plan: {mine * 1e3:.4f} ms)")
            lines += [f"  {h}" + (f" ({((h.written or h.time) / mine - 1) * 100:+.1f}% against auto, as written)"
                                  if h.time is not None and mine else "") for h in self.hand_plans]
        lines.append(f"solver: {self.solver.get('status', '')} in {self.solver.get('seconds', 0):.2f} s, "
                     f"gap {self.solver.get('gap', 0):.2%}; decisions below are priced on the solver's problem "
                     f"(step {self.solver.get('objective', 0) * 1e3:.4f} ms before refinement)")
        for kind, b in sorted(self.breakdown.items(), key=lambda kv: -(kv[1]["compute"] + kv[1]["communication"])):
            lines.append(f"  {kind:<22} compute {b['compute'] * 1e6:10.2f} us  communication "
                         f"{b['communication'] * 1e6:10.2f} us  bytes {b['bytes']:,.0f}")
        return "\n".join(lines)


class SearchStrategies:
    name = "search-strategies"

    def __init__(self, cost: CostModel = DEFAULT_COST, memory_limit: Optional[int] = None,
                 time_limit: Optional[float] = 60.0, allow_reduce_scatter: bool = True,
                 memory_method: str = "exact", memory_tolerance: float = 0.01, exact_ops: int = EXACT_OPS,
                 time_budget: Optional[float] = TIME_BUDGET, deadline: Optional[float] = None,
                 relaxed_gap: Optional[float] = RELAXED_GAP, pick: Optional[str] = None,
                 compare_hands: bool = False):
        """``deadline``: when the budget ends (``time.perf_counter()``), where the searches of
        one compile share it; None: ``time_budget`` seconds from each call. ``relaxed_gap``:
        under a limit, a rounded LP plan proven within this of the best is kept without
        the exact rows (None: the exact rows always). ``pick``: write the hand plan of
        this ``HandPlan.label`` instead of searching (``compiler/measure.py`` times it
        beside the search's plan). ``compare_hands``: solve the hand plans without a memory
        limit too (under one they always are), for ``measure=True`` to time."""
        self.pick, self.compare_hands = pick, compare_hands
        self.relaxed_gap = relaxed_gap
        self.cost = cost
        self.time_budget = time_budget
        self.deadline = deadline
        self._deadline = None
        self.exact_ops = exact_ops
        # the user's limit (or the device's memory, as parallelize found it), else the profile's
        self.memory_limit = memory_limit if memory_limit is not None else getattr(cost, "memory_capacity_bytes", None)
        self.time_limit = time_limit
        self.allow_rs = allow_reduce_scatter
        if memory_method not in ("lagrange", "exact"):
            raise ShardingError(f"memory_method={memory_method!r}: use 'exact' (exact memory rows; Lagrange "
                                "multipliers only where a solve runs out of time) or 'lagrange' (multipliers first, "
                                "exact rows where they leave a gap above memory_tolerance)")
        self.memory_method, self.memory_tolerance = memory_method, memory_tolerance

    def __call__(self, graph: Graph) -> Graph:
        meshes = self._arrangements(graph)
        # arrangements share what does not depend on the mesh: the nodes and templates,
        # and the redistribution prices (by virtual problem, plan_core/pricing.py)
        prices, last = Prices(self.cost, self.allow_rs), None
        solved, best_objective = [], None
        self._hands = []
        self._phases = {}   # seconds per part of the search (plan.cost.solver["phases"])
        self._deadline = self.deadline if self.deadline is not None else \
            None if self.time_budget is None else time.perf_counter() + self.time_budget
        self._skipped = []     # arrangements that ran out of time before any plan
        self._beaten = []      # arrangements whose bound no plan of theirs could beat the plan found with
        with self._phase("arrangements' bounds"):
            order = self._by_bound(graph, meshes, prices)
        for i, (mesh, built, bound) in enumerate(order):
            # (measure=True times hand plans the model may misrank: every arrangement's are wanted)
            if _cannot_beat(bound, best_objective) and not self.compare_hands:
                self._beaten.append(f"{mesh} (no plan there is under {bound * 1e3:.6g} ms, its LP bound; "
                                    f"the plan found is {best_objective * 1e3:.6g} ms)")
                continue
            graph.set_mesh(mesh)
            # a later arrangement need only consider candidates that could beat the best
            # plan so far (its solver's objective: the plan before refinement)
            try:
                found = self.search(graph, beat=best_objective, prices=prices, like=last, refine=len(meshes) == 1,
                                    problem=built)
            except ShardingError as e:
                # (out of time before any plan: the other arrangements' plans stand; the 2-layer
                # GPT step on 8 devices at half the free plan's peak raised here, the budget spent
                # by the first arrangement's memory rounds, which had found a plan)
                if len(meshes) == 1 or (i == len(meshes) - 1 and not solved):
                    raise
                self._skipped.append(f"{mesh}: {str(e).splitlines()[0]}")
                continue
            last = found[0]
            solved.append((mesh,) + found)
            if found[1] is not None and (best_objective is None or found[1].objective < best_objective):
                best_objective = found[1].objective
        if self.pick is not None:   # (the arrangement that has the hand plan of that name, refined already)
            mesh, problem, solution, peak = next((s for s in solved if s[2] is not None), solved[0])
        else:
            mesh, problem, solution, peak = self._refine_best(graph, solved) if len(meshes) > 1 else solved[0]
        graph.set_mesh(mesh)
        if solution is None:
            if self.pick is not None:
                named = [h for h in self._hands if h.label == self.pick]
                if named:   # (it exists: over the limit, or not solved)
                    raise ShardingError(f"the hand plan {self.pick!r} does not fit on {graph.mesh}: "
                                        f"{'; '.join(str(h) for h in named)}")
                raise ShardingError(f"no hand plan {self.pick!r} on {graph.mesh} among "
                                    f"{[h.label for h in self._hands]}: pick one of those")
            raise self._overflow(problem, peak)
        bodies = self._write(graph, problem, solution)
        graph.auto = self._result(problem, solution, _loop_bodies(graph, bodies))
        graph.auto.hand_plans = list(self._hands)
        graph.auto.solver["phases"] = dict(self._phases)
        if self._skipped:
            graph.auto.solver["status"] += "; arrangements left out, out of time: " + "; ".join(self._skipped)
        if self._beaten:
            graph.auto.solver["status"] += "; arrangements not searched, bound above the plan: " + \
                "; ".join(self._beaten)
        return graph

    def _by_bound(self, graph: Graph, meshes: list, prices: Prices) -> list:
        """(mesh, its problem or None, a lower bound on its plans' modeled time or None) per
        arrangement, the least bound first. The bound is the problem's LP relaxation without
        memory rows (every plan that fits a limit is a plan). Searched in that order, an
        arrangement whose bound is no cheaper than a plan already found is not searched at
        all: on the 2-layer GPT step on 8 devices the search went 2 x 4 (bound 19.92 ms)
        before 4 x 2 (16.96 ms), and spent the budget at half the free peak on 2 x 4's
        memory rounds, where 4 x 2 alone finds a plan 18% cheaper. With ``compare_hands``
        (measure=True, which times hand plans the model may misrank) every arrangement is
        searched, in that order. One mesh, a hand plan
        picked by name (every arrangement's hand plans are wanted), or a graph small enough
        to be searched un-coarsened too (the coarse problem's LP bounds none of those
        plans), or no memory limit (each arrangement's search is then that same LP, and the
        MILP where it is fractional: the bounds cost more than they save, 3.3 s against 2.9 s
        on the 2-layer GPT step): the arrangements as they come, with no bound."""
        if len(meshes) == 1 or self.pick is not None or len(graph.ops) <= self.exact_ops or \
                self.memory_limit is None:
            return [(m, None, None) for m in meshes]
        problems, like = [], None
        for mesh in meshes:
            graph.set_mesh(mesh)
            problem = Problem(graph, self.cost, allow_reduce_scatter=self.allow_rs, prices=prices, like=like)
            like = problem
            problems.append(problem)
        left = self._left()

        def bound_of(problem: Problem) -> Optional[float]:
            bound = memo.LP_BOUNDS.get(problem.fingerprint)
            if bound is None:
                try:
                    lp = milp.solve(milp.reduce(problem, memory_matters=False), relax=True,
                                    time_limit=None if left is None else max(left, 0.5))
                    bound = lp.bound if lp.choice and np.isfinite(lp.bound) else None
                except ShardingError:   # (out of time: searched last, with no bound)
                    bound = None
            return bound
        # (the LPs side by side: HiGHS lets go of the GIL while it solves; on 2 cores the two
        # of the 4-layer GPT step took 1.4 s against 2.1-2.5 s one after the other. Each
        # solved beside the next problem's build instead gained nothing more: the build holds
        # the GIL)
        with ThreadPoolExecutor(max_workers=max(1, min(len(problems), os.cpu_count() or 1))) as pool:
            bounds = list(pool.map(bound_of, problems))
        out = []
        for mesh, problem, bound in zip(meshes, problems, bounds):
            if bound is not None:
                memo.remember(memo.LP_BOUNDS, problem.fingerprint, bound, memo.LP_BOUNDS_MAX)
            out.append((mesh, problem, bound))
        return sorted(out, key=lambda mpb: np.inf if mpb[2] is None else mpb[2])

    @contextmanager
    def _phase(self, name: str):
        """Add the seconds of the block to ``name``'s (what a search spends where)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            phases = self.__dict__.setdefault("_phases", {})
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    def _refine_best(self, graph: Graph, solved: list) -> tuple:
        """Of several arrangements' solved plans, refine and keep the cheapest. Refinement
        is for the plan that is kept: in order of solved cost, an arrangement is refined
        while its solved plan is cheaper than the best refined one so far (refinement
        gained 0-0.7% on the GPT steps of bench/auto.py, and arrangements' solved plans
        lie further apart than that, or tie)."""
        fitting = sorted((f for f in solved if f[2] is not None), key=lambda f: f[2].objective)
        if not fitting:
            return solved[0]
        best = None
        for mesh, problem, sol, _ in fitting:
            if best is not None and sol.objective >= best[2].modeled - 1e-15:
                break
            graph.set_mesh(mesh)
            peak = self._refine(graph, problem, sol, self.memory_limit)
            if best is None or sol.modeled < best[2].modeled - 1e-15:
                best = (mesh, problem, sol, peak)
        return best

    # -- the search -----------------------------------------------------------------
    def search(self, graph: Graph, follow: bool = True, share_layers: bool = True, beat: Optional[float] = None,
               prices: Optional[Prices] = None, like: Optional[Problem] = None, refine: bool = True,
               hands: bool = True, problem: Optional[Problem] = None):
        """(problem, solution, its peak), or if nothing fits the memory limit (problem,
        None, (peak, choice) of the smallest-peak plan the rounds met, or None); ``beat``:
        the modeled time of a plan found elsewhere (only candidates that could beat it
        are searched); ``prices``, ``like``: shared with the search of another
        arrangement (``Problem``); ``refine=False``: the solved plan, not yet refined
        (``_refine``), unless the graph is small enough to be solved exactly too.
        ``problem``: this arrangement's, built already (``_by_bound``)."""
        with self._phase("problem"):
            if problem is None:
                problem = Problem(graph, self.cost, follow=follow, share_layers=share_layers,
                                  allow_reduce_scatter=self.allow_rs, prices=prices, like=like)
            limit = self.memory_limit
            memory = _Liveness(graph, problem)
            # a plan to beat: every decision at its first candidate (the whole tensor, or what
            # the marks fix), if it fits; no candidate that cannot beat it is searched
            first = {t: 0 for t in problem.unary}
            upper = problem.objective(first) if limit is None or memory.peak(first)[0] <= limit else None
        # the hand plans (hand.py): the best that fits is a plan to beat, and the fallback
        # (without a limit the solve's optimum is at most each of them: each is this problem
        # with its arguments' layouts narrowed; they matter where memory rows bind)
        with self._phase("warm LP model"):
            fams = hand.families(problem) if hands and (limit is not None or self.compare_hands) else []
            warm = _warm_model(problem, memory, fams) if limit is not None else None
        t_hand = time.perf_counter()
        peaks = []   # where the hand plans solved for time alone peak over the limit (the rounds' first rows)

        def fit(allowed, choice):
            peaks.append(memory.peak(choice)[1])
            return self._fit_hand(problem, memory, limit, allowed, choice)

        def dive(allowed, lp, rounding):
            return self._dive_hand(problem, warm, allowed, lp, rounding)
        with self._phase("hand plans"):
            plans = hand.hand_plans(problem, lambda c: memory.peak(c)[0], limit, time_limit=self.time_limit,
                                    fams=fams, warm=warm, fit=fit if limit is not None else None,
                                    every=self.pick is not None, margin=self.relaxed_gap or 0.0,
                                    dive=dive if warm is not None else None) if fams else []
        if self._deadline is not None:
            # (the hand plans are solved in full, each within time_limit: what they compare
            # with must be there; the budget is for the search's own rounds, which on a
            # loaded machine found it spent by the hand plans and returned one of them)
            self._deadline += time.perf_counter() - t_hand
        for h in plans:
            h.axes = f"{h.axes} ({problem.mesh})"
        self._hands = getattr(self, "_hands", []) + plans
        if self.pick is not None:
            return self._picked(graph, problem, plans, limit)
        # the plan to return at least as cheap as, as written (a copy several ops read made
        # once, as insert-reshards writes it: the objective prices it once per reader, which
        # put Megatron's plans up to 28% above their programs, the layer norms' partial
        # gradients read by three ops each); the bound on the objective is the least of theirs
        start = hand.best(plans)
        least = hand.bound(plans)
        if least is not None:
            upper = least if upper is None else min(upper, least)
        if beat is not None:
            upper = beat if upper is None else min(upper, beat)
        with self._phase("reduce"):
            red = milp.reduce(problem, memory_matters=limit is not None, upper=upper)
            # for the error: the least peak of the plans met so far (the hand plans too: on the
            # 1-D mesh of bench/zoo.py's megatron_mlp, every decision at its fewest bytes peaked
            # at 1.54 MB, which the error reported as the smallest, beside Megatron's 0.95 MB)
            smallest = None
            if limit is not None:
                met = [(memory.peak(first)[0], first)] + [(h.peak, h.choice) for h in plans
                                                          if h.choice is not None and h.peak is not None]
                smallest = min(met, key=lambda pc: pc[0])
        if limit is None:
            with self._phase("solve"):
                sol = milp.solve(red, time_limit=self.time_limit)
            sol.rounds = 1
        else:
            # the first row: where the least narrowed hand plan over the limit peaks (DP's first:
            # the unlimited optimum, like DP, peaks where the arguments and the activations
            # meet), rather than an unlimited solve; the LP rounds add the others where their
            # plans overflow. Each row makes the dual simplex's iterations dearer (1.7 against
            # 0.4 ms on the 2-layer GPT step on 4 x 2 at 0.7): seeded with the rows of every
            # hand plan over the limit, the 12-layer GPT step on 4 x 2 searched 20.3 s at 0.7
            # and 11.7 s at 0.9, seeded with one 12.6 and 9.3 s, to the same or cheaper plans
            first = next((h for h in plans if h.choice is not None and not h.fits), None)
            over = [memory.peak(first.choice)[1]] if first is not None else peaks[:1]
            if not over:
                # (every hand plan fits: the first row is where the cheapest peaks, which every plan
                # that fits meets too; finding the unlimited optimum's peak by an exact solve instead
                # took 0.8 s of the 2-layer GPT step's 7 s on 2 x 4 at 0.7, 2.4 s of the 4-layer's 12 s)
                cheapest = min((h for h in plans if h.choice is not None), key=lambda h: h.time, default=None)
                over = [memory.peak(cheapest.choice)[1]] if cheapest is not None else []
            # (the un-coarsened search of a small graph is there to be exact: its exact rows are
            # not cut short, the coarse plan to beat keeping the problem small)
            sol, smallest = self._solve_under_limit(red, problem, memory, limit, smallest, start, seed=over,
                                                    warm=warm, brief=EXACT_AFTER_ROUNDED_S if follow or share_layers
                                                    else None, beat=beat)
            if sol is None and start is None:
                return problem, None, smallest
        small = follow and share_layers and len(graph.ops) <= self.exact_ops
        if sol is not None and sol.choice:
            with self._phase("refine"):
                peak = self._settle(graph, problem, sol)
                if refine or small:
                    peak = self._refine(graph, problem, sol, limit)
        if start is not None and (sol is None or not sol.choice or
                                  start.written < problem.written(*sol.plan) * (1 - 1e-9)):
            sol, peak = self._from_hand(graph, problem, start, sol, limit, refine or small)
        found = (problem, sol, peak)
        left = self._left() if limit is not None else None
        if small and (left is None or left > 0):
            # small enough to solve without coarsening: keep whichever plan is cheaper
            exact = self.search(graph, follow=False, share_layers=False, beat=sol.modeled, prices=prices,
                                hands=False)
            if exact[1] is not None and exact[1].modeled < sol.modeled - 1e-15:
                exact[1].status += " (the un-coarsened problem: every op its own decision)"
                return exact
        return found

    def _from_hand(self, graph: Graph, problem: Problem, start, sol, limit, refine: bool):
        """The hand plan ``start`` as the search's plan (the solve found none cheaper
        under the model), refined; its peak."""
        out_of_time = self._deadline is not None and time.perf_counter() >= self._deadline
        why = ("found no plan within its time budget" if out_of_time else "found no plan") \
            if sol is None or not sol.choice else \
            f"found none cheaper as written (its best {problem.written(*sol.plan) * 1e3:.4f} ms, " \
            f"{sol.modeled * 1e3:.4f} ms a copy per reader)"
        bound = max(getattr(self, "_bound", 0.0), getattr(sol, "bound", 0.0) if sol else 0.0)
        out = milp.Solution(dict(start.choice), start.time, bound, 0.0,
                            f"the hand plan {start.name} ({start.axes}): the search {why}",
                            getattr(sol, "seconds", 0.0) if sol else 0.0, getattr(sol, "variables", 0) if sol else 0,
                            getattr(sol, "binaries", 0) if sol else 0)
        out.rounds = getattr(sol, "rounds", 1) if sol else 1
        out.bound = min(out.bound, start.time)
        out.gap = (start.time - out.bound) / start.time if start.time and out.bound else 0.0
        peak = self._settle(graph, problem, out)
        if refine:
            kept = (out.plan, out.peak, out.modeled, out.claimed)
            peak = self._refine(graph, problem, out, limit)
            if problem.written(*out.plan) > start.written * (1 + 1e-12):   # (refinement lowers the
                out.plan, out.peak, out.modeled, out.claimed = kept            # objective, not always this)
                peak = out.peak
        return out, peak

    def _fit_hand(self, problem: Problem, memory: "_Liveness", limit: float, allowed: dict,
                  choice: dict) -> Optional[dict]:
        """A plan of the hand family narrowed to ``allowed`` that fits ``limit``, where its
        time-optimal plan ``choice`` does not (``repair.fit_by_switching``, within
        ``HAND_FIT_S``), or None."""
        with self._phase("hand plans under the limit"):
            return fit_by_switching(problem, memory, limit, choice, allowed, time.perf_counter() + HAND_FIT_S)

    def _dive_hand(self, problem: Problem, warm, allowed: dict, lp, rounding: Optional[dict]) -> Optional[dict]:
        """A hand family's fractional LP (solved for time: no memory rows) dived to an
        integral plan (``_dive`` on ``warm`` narrowed to ``allowed``, from its ``rounding``,
        within ``hand.HAND_MILP_S``): the cheapest plan it meets, or None. The warm model's
        basis is put back after, so the next solve goes on from where the families left it."""
        with self._phase("hand plans' dives"):
            kept = {t: np.intersect1d(k, allowed[t]) if t in allowed else k for t, k in warm.red.kept.items()}
            incumbent = (problem.objective(rounding), rounding) if rounding is not None else None
            basis = warm.basis()
            try:
                return _dive(lp, warm, SimpleNamespace(kept=kept), [], None, time.perf_counter() + hand.HAND_MILP_S,
                             problem, fits=lambda choice: True, incumbent=incumbent)
            finally:
                warm.restore(basis)

    def _picked(self, graph: Graph, problem: Problem, plans: list, limit):
        """(problem, the hand plan named ``self.pick`` as the plan, its peak), refined as the
        search's own would be; (problem, None, None) where this arrangement has none that fits."""
        h = next((h for h in plans if h.label == self.pick and h.fits and h.choice is not None), None)
        if h is None:
            return problem, None, None
        sol, peak = self._from_hand(graph, problem, h, None, limit, refine=True)
        sol.status = f"the hand plan {h.label}, picked (measure=True times it beside the search's plan)"
        return problem, sol, peak

    def _left(self) -> Optional[float]:
        """Seconds a solve may take: the time limit, or what is left of the budget."""
        if self._deadline is None:
            return self.time_limit
        left = self._deadline - time.perf_counter()
        return left if self.time_limit is None else min(self.time_limit, left)

    def _multipliers_seconds(self) -> Optional[float]:
        """Seconds the multipliers get where the exact rows found no plan in time: what is
        left of the budget, but at least ``MULTIPLIERS_MIN_S``, ending no later than that
        long past the budget's end (with the compile's shared deadline, the memory check's
        searches again had each taken the 10 s whole: a 119-op program on a 2 x 2 x 2 mesh,
        under a limit no plan met once compiled, took 64 s against its 20 s budget)."""
        left = self._left()
        if left is None:
            return self.time_limit
        return max(left, min(MULTIPLIERS_MIN_S, left + MULTIPLIERS_MIN_S))

    def _solve_under_limit(self, red, problem: Problem, memory: "_Liveness", limit: float, smallest: tuple,
                           start=None, seed=(), warm=None, brief: Optional[float] = EXACT_AFTER_ROUNDED_S,
                           beat: Optional[float] = None):
        """(solution that fits or None, the smallest-peak plan met). Each part below offers
        the plans it meets that fit and raises the bound it proves; the cheapest plan
        offered is returned with the largest bound (``_Best``), so a later part can only
        improve on an earlier one's plan, never lose it. In order:

        1. With ``memory_method="lagrange"``, the multipliers (``lagrange.py``), kept where
           proven within ``memory_tolerance``.
        2. The rows' LP relaxation, rounded and dived (``_relaxed_round``), from the rows
           ``seed`` gives (where the first hand plan over the limit peaks, or where the
           cheapest peaks if all fit; else where the unlimited plan does), a row added where its plans overflow, until a plan is
           proven within ``relaxed_gap`` or the LP is integral.
        3. The exact rows: solve, add the row where the plan peaks over the limit, solve
           again. With no plan yet they get what is left of the budget, and where a solve
           runs out of time before any plan (and no hand plan fits) the multipliers are
           the last resort. With a plan outside ``relaxed_gap``, first one LP round dived
           from it for at most ``DIVE_FAR_FIRST_S``, then the multipliers
           from the rows so far, for at most ``MULTIPLIERS_BRIEF_S`` (they meet rows in
           unlimited solves, which are fast where the DP solves most of the problem, and
           their bound may prove the plan), the LP rounds again from the rows they met,
           dived (the first LP rounds dive only where no rounding fits), then the exact rows from every
           row met, for at most ``brief`` seconds (None: the budget, solved to optimality;
           the un-coarsened search of a small graph, which is there to be exact), where the
           warm model's cold LP took under ``EXACT_ROOT_SHARE`` of them.

        ``start``: the best hand plan that fits (``hand.py``); where the budget runs out
        with no plan the search returns None and falls back to it. ``warm``: the problem's
        ``warm_lp.WarmLP`` (the LP rounds go on from its last basis), or None. ``beat``:
        the objective of a plan another arrangement found; once the bound proven here
        reaches it, no plan here can beat it, and the parts stop (on the 2-layer GPT step
        on 8 devices at 0.5, 2 x 4's LP rounds passed 4 x 2's plan 2.4 s before its
        search ended)."""
        t0 = time.perf_counter()
        best = _Best(problem)
        self._bound = 0.0
        rows, points = [], set()
        notes = []   # what the parts whose plan is not kept found
        lag = None

        def beaten() -> bool:
            if not _cannot_beat(self._bound, beat):
                return False
            if not any(n.startswith("stopped:") for n in notes):
                notes.append(f"stopped: the bound {self._bound * 1e3:.4f} ms reached the plan to beat "
                             f"({beat * 1e3:.4f} ms, another arrangement's)")
            return True

        def add_row(at: int):
            if at not in points:
                rows.append(memory.row(at))
                points.add(at)

        def multipliers(seconds: Optional[float]):
            nonlocal smallest, lag
            with self._phase("multipliers"):
                lag = lagrange.search(red, problem.objective, memory.peak, memory.row, limit,
                                      tolerance=self.memory_tolerance, time_limit=seconds, rows=rows)
            for row in lag.rows[len(rows):]:
                add_row(row.point)
            if lag.smallest is not None and lag.smallest[0] < smallest[0]:
                smallest = lag.smallest
            self._bound = max(self._bound, lag.bound)
            best.rounds += lag.iterations
            how = f"Lagrange multipliers on {len(lag.rows)} memory rows ({lag.iterations} solves, {lag.seconds:.1f} s)"
            if lag.choice is None or not best.offer(lag.choice, "the multipliers", how):
                notes.append(how + (", no plan that fits" if lag.choice is None else ", none cheaper"))

        def exact_rows(seconds: Optional[float], rounds: int = MAX_MEMORY_ROUNDS):
            """Until a plan fits the limit, ``seconds`` (None: the budget) or ``rounds`` run
            out, or the rows leave no plan; the time limit's error where a solve ran out
            of time before any plan, else None."""
            nonlocal smallest
            until = None if seconds is None else time.perf_counter() + seconds
            for _ in range(rounds):
                left = self._left()
                if left is not None and left <= 0.05 and (start is not None or best.choice is not None):
                    return None   # (the budget is spent: the best plan so far, with the bound so far)
                if beaten():
                    return None
                if until is not None:
                    left = until - time.perf_counter() if left is None else min(left, until - time.perf_counter())
                try:
                    with self._phase("exact rows"):
                        sol = milp.solve(red, rows, limit, None if left is None else max(left, 0.5),
                                         **({} if until is None else {"rel_gap": self.relaxed_gap}))
                except ShardingError as e:   # (the time limit, before any plan)
                    notes.append("the exact rows found no plan within their time limit")
                    return e
                best.rounds += 1
                if not sol.choice:
                    return None   # (no plan meets the rows)
                if np.isfinite(sol.bound):   # (each round's problem relaxes the next, and the limit's)
                    self._bound = max(self._bound, sol.bound)
                best.size = (sol.variables, sol.binaries)
                peak, at = memory.peak(sol.choice)
                if peak <= limit:
                    if not best.offer(sol.choice, "the exact rows", sol.status):
                        notes.append(f"the exact rows' plan that fits is dearer "
                                     f"({problem.objective(sol.choice) * 1e3:.4f} ms)")
                    return None
                if peak < smallest[0]:
                    smallest = (peak, sol.choice)
                add_row(at)
                if until is not None and time.perf_counter() >= until:
                    break
            if best.choice is not None:
                notes.append("the exact rows found none cheaper within " +
                             ("the time budget" if seconds is None else f"{seconds:.0f} s"))
            return None

        def lp_rounds(dive_far: bool, most: int = MAX_MEMORY_ROUNDS, far_s: float = DIVE_FAR_S):
            """The rows' LP, rounded and dived, a row added where its plans overflow, until
            a plan is within ``relaxed_gap``, no new row or ``most`` rounds (``dive_far``: dive
            from a rounding that fits outside ``relaxed_gap`` too)."""
            for _ in range(most):
                left = self._left()
                if best.choice is not None and best.gap(self._bound) <= self.relaxed_gap:
                    break   # (an integral LP's plan that fits is proven too: its gap is nil)
                if beaten():
                    break
                if not rows or (left is not None and left <= 0.05 and (start is not None or best.choice is not None)):
                    break
                with self._phase("LP rounds"):
                    plan, what, _ = self._relaxed_round(red, problem, memory, rows, points, limit, left, warm,
                                                        dive_far=dive_far, far_s=far_s, beat=beat)
                best.rounds += 1
                if plan is not None:
                    best.offer(plan[1].choice, "the LP rounds", plan[1].status)
                    best.size = (plan[1].variables, plan[1].binaries)
                if what != "more":
                    break

        if self.memory_method == "lagrange":
            multipliers(self._multipliers_seconds())
            if best.choice is not None and best.gap(self._bound) <= self.memory_tolerance:
                return best.solution(self._bound, notes, time.perf_counter() - t0), smallest
        if self.relaxed_gap is not None:
            for at in seed:
                add_row(at)
            if not rows:   # (no hand plan over the limit: the first row is where the unlimited plan peaks)
                exact_rows(None, rounds=1)
            lp_rounds(dive_far=False)
        left = self._left()
        if best.choice is None or self.relaxed_gap is None:
            error = exact_rows(None)
            if error is not None and best.choice is None:
                if start is not None:
                    return None, smallest   # (the hand plan, with the bound so far)
                seconds = self._multipliers_seconds()
                if lag is None and (seconds is None or seconds > 0):
                    multipliers(seconds)
                if best.choice is None:   # (what was met, and the fixes: more time among them)
                    raise self._overflow(problem, smallest, out_of_time=str(error).splitlines()[0])
        elif best.gap(self._bound) > self.relaxed_gap and (left is None or left > 0.05) and not beaten():
            # (a plan outside relaxed_gap: a brief dive from it first, then rows and a bound met
            # cheaply by the multipliers: on the 2-layer GPT step on 2 x 4 at 0.5 they proved the
            # rounding optimal in 3 s, where the dive from it had spent 9 s and found none cheaper;
            # then the LP again from their rows, warm, dived; then the exact rows from all of
            # them, briefly)
            lp_rounds(dive_far=True, most=1, far_s=DIVE_FAR_FIRST_S)
            if lag is None and best.gap(self._bound) > self.relaxed_gap and not beaten():
                multipliers(MULTIPLIERS_BRIEF_S if left is None else min(left, MULTIPLIERS_BRIEF_S))
            if best.gap(self._bound) > self.relaxed_gap:
                lp_rounds(dive_far=True)
            if best.gap(self._bound) > self.relaxed_gap and not beaten():
                cold = warm.cold_seconds() if warm is not None else None
                if brief is not None and cold is not None and cold >= EXACT_ROOT_SHARE * brief:
                    notes.append(f"the exact rows not tried: the LP's cold solve took {cold:.1f} s, too long for "
                                 f"branch and bound to get past its root in {brief:g} s")
                else:
                    exact_rows(brief)
        if best.choice is None:
            return None, smallest
        return best.solution(self._bound, notes, time.perf_counter() - t0), smallest

    def _relaxed_round(self, red, problem: Problem, memory: "_Liveness", rows: list, points: set, limit: float,
                       left: Optional[float], warm=None, dive_far: bool = True, far_s: float = DIVE_FAR_S,
                       beat: Optional[float] = None) -> tuple:
        """One LP round under the memory rows: the LP relaxation (its optimum is a lower
        bound on every plan that fits), rounded (``_roundings``: each decision to its
        heaviest candidate, then more and more fractional ones to the candidate holding
        the fewest bytes in the rows). ((time, Solution)
        of the cheaper rounding that fits, or None; what next: "optimal" (the LP was
        integral and its plan fits), "more" (no rounding fits, and a new row was added at
        a point where one peaks), "exact" (the exact rows must go on); seconds).
        ``dive_far=False``: no dive from a rounding that fits outside ``relaxed_gap`` (the
        multipliers go first). ``beat``: another arrangement's plan; no dive once the LP's
        bound reaches it (no plan here can beat it)."""
        try:
            lp = warm.solve(red.kept, rows, limit, None if left is None else max(left, 0.5)) if warm is not None \
                else milp.solve(red, rows, limit, None if left is None else max(left, 0.5), relax=True)
        except ShardingError:   # (its time limit: the exact rows decide, or the fallbacks)
            return None, "exact", 0.0
        if not lp.choice:
            return None, "exact", lp.seconds
        if np.isfinite(lp.bound):   # (a relaxation of the problem under the limit)
            self._bound = max(self._bound, lp.bound)
        best, new_points, over = None, [], []   # (over: (peak, choice) of the plans over the limit)
        with self._phase("roundings"):
            plans = _roundings(lp, rows, memory, limit, problem=problem)
        seconds = lp.seconds

        def consider(choices):
            nonlocal best
            for choice in choices:
                peak, at = memory.peak(choice)
                if peak <= limit:
                    t = problem.objective(choice)
                    if best is None or t < best[0]:
                        best = (t, choice)
                    continue
                over.append((peak, choice))
                if at not in points and at not in new_points:
                    new_points.append(at)
        consider(plans)
        if best is None and not new_points:
            with self._phase("roundings repaired"):
                until = time.perf_counter() + HAND_FIT_S
                for _, rounding in sorted(over, key=lambda pc: pc[0]):
                    fitted = fit_by_switching(problem, memory, limit, rounding, red.kept, until)
                    if fitted is not None:
                        consider([fitted])
                        break
        if best is None and new_points:
            # (no rounding fits, and they overflow where the LP has no row: a dive on this LP
            # would end at plans overflowing there too; on the 2-layer GPT step on 4 x 2 at 0.7
            # it spent 9.5 s to end at one. The rows first, then the LP again, warm)
            for at in new_points:
                rows.append(memory.row(at))
                points.add(at)
            return None, "more", seconds
        # a plan proven within relaxed_gap by the root LP's bound is what the search keeps:
        # from one the dive goes on for at most DIVE_POLISH_S (on the 2-layer GPT step on
        # 4 x 2 at 0.7 it dived on from a rounding 4.5% above the bound for 11 s and found
        # none cheaper; on 2 x 4 at 0.9, from one 1.3% above it, it found one 0.6% above in 1.1 s)
        enough = None if self.relaxed_gap is None else self._bound / (1 - self.relaxed_gap)
        if warm is not None and lp.rounded and (best is None or dive_far or (enough is not None and best[0] <= enough)) \
                and not _cannot_beat(self._bound, beat):
            t0 = time.perf_counter()
            deadline = self._deadline
            if best is not None and (enough is None or best[0] > enough):   # (a far dive: brief)
                deadline = min(deadline or np.inf, t0 + far_s)
            with self._phase("dive"):
                # (from the best rounding that fits: the dive stops once it cannot beat that)
                dived = _dive(lp, warm, red, rows, limit, deadline, problem,
                              fits=lambda c: memory.peak(c)[0] <= limit, incumbent=best, enough=enough,
                              polish=DIVE_POLISH_S)
            seconds += time.perf_counter() - t0
            if dived is not None:
                consider([dived])
        if best is not None:
            t, choice = best
            gap = max(0.0, (t - self._bound) / t) if t else 0.0
            how = "its optimum is integral" if not lp.rounded else f"rounded, within {gap:.2%} of its bound"
            sol = milp.Solution(choice, t, self._bound, gap if lp.rounded else 0.0,
                                f"LP relaxation under {len(rows)} memory rows ({how})", seconds, lp.variables,
                                lp.binaries)
            if lp.rounded and warm is not None and new_points and \
                    (self.relaxed_gap is None or gap > self.relaxed_gap):
                # (a plan that fits, far from the bound, while the LP's own plans overflow at a
                # point it has no row for: that row, and the LP again, warm, before the exact rows)
                rows.append(memory.row(new_points[0]))
                points.add(new_points[0])
                return (t, sol), "more", seconds
            return (t, sol), "exact" if lp.rounded else "optimal", seconds
        for at in new_points[:1]:
            rows.append(memory.row(at))
            points.add(at)
        return None, "more" if new_points else "exact", seconds

    def _settle(self, graph: Graph, problem: Problem, sol) -> float:
        """The solved plan, priced (its objective without the solver's tie-break); its peak."""
        sol.objective = problem.objective(sol.choice)   # (the solver's includes the tie-break)
        sol.plan = problem.op_strategies(sol.choice)
        sol.peak = plan_peak(graph, *sol.plan)
        sol.modeled = sol.claimed = sol.objective
        return sol.peak

    def _refine(self, graph: Graph, problem: Problem, sol, limit) -> float:
        """Refine the solved plan (kept only where it still fits, and is no dearer as
        written: refinement lowers the objective, a copy priced once per reader, and on the
        4-layer GPT step on 2 x 4 at 0.9 it took the search's plan from 35.99 to 36.96 ms as
        written, above the hand plan Megatron's 36.57, which was returned); its peak."""
        *refined, gain = refine(problem, *sol.plan)
        refined_peak = plan_peak(graph, *refined)
        sol.claimed = sol.objective   # what the engine says its plan costs (the evaluator must agree)
        if (limit is None or refined_peak <= limit) and \
                problem.written(*refined) <= problem.written(*sol.plan) * (1 + 1e-12):
            sol.plan, sol.peak = tuple(refined), refined_peak
            sol.claimed = sol.objective - gain
        e = problem.evaluate(*sol.plan)
        sol.modeled = e["compute"] + e["communication"]
        return sol.peak

    def _arrangements(self, graph: Graph) -> list[Mesh]:
        """The meshes to search: the graph's own, or on a device-count mesh with nothing
        pinned to its axes, every arrangement of the devices into one or two axes."""
        pinned = graph.pinned_inputs or graph.pinned_outputs or any(
            user_fixed(op) or op.kind in FIXED for _, op in graph.walk_ops())
        n = graph.mesh.size
        if not graph.count_mesh or pinned or n == 1:
            return [graph.mesh]
        shapes = [(a, n // a) for a in range(2, n) if n % a == 0] or [(n,)]
        return [Mesh(tuple(f"d{i}" for i in range(len(s))), s) for s in shapes]

    # -- the plan into the graph ------------------------------------------------------
    def _write(self, graph: Graph, problem: Problem, sol) -> PropagateSharding:
        """The plan into the graph, and its loop and branch bodies planned by propagation
        with their boundary pinned to it (the propagation that planned them, returned)."""
        ops, inputs = sol.plan
        write_plan(graph, inputs, ((op, ops[op], *_origin(graph, op, n.root), None)
                                   for n in problem.nodes for op in n.members))
        bodies = PropagateSharding(cost=self.cost, allow_reduce_scatter=True)
        for op in graph.ops:
            for body, pins_in, pins_out in boundary_layouts(op, graph.mesh):
                body.pinned_inputs.update(pins_in)
                body.pinned_outputs.update(pins_out)
                bodies(body)
        return bodies

    # -- what the plan costs, and the decisions that matter ----------------------------
    def _result(self, problem: Problem, sol, loops: dict) -> SearchResult:
        """What ``plan.cost`` shows: the plan priced by the one evaluator, and the moves its
        loop bodies make (``loops``, ``_loop_bodies``), which the objective does not see."""
        ops, inputs = sol.plan
        breakdown: dict = {}
        e = problem.evaluate(ops, inputs, breakdown)
        compute, comm, moved, flops = e["compute"], e["communication"], e["bytes"], e["flops"]
        if loops["communication"] or loops["bytes"]:
            breakdown["(loop bodies)"] = dict(compute=0.0, **loops)
            comm, moved = comm + loops["communication"], moved + loops["bytes"]
        mesh = problem.mesh
        # claimed: the objective less what refinement says its moves saved (the evaluator must agree)
        solver = dict(status=sol.status, seconds=sol.seconds, objective=sol.objective, claimed=sol.claimed,
                      bound=sol.bound, gap=sol.gap,
                      variables=sol.variables, binaries=sol.binaries, nodes=len(problem.nodes),
                      decisions=len(problem.unary), memory_rounds=getattr(sol, "rounds", 1),
                      loop_bodies=loops["communication"])
        return SearchResult(compute + comm, compute, comm, moved, getattr(sol, "peak", 0.0), flops,
                            self.memory_limit, str(mesh), solver, breakdown, self._decisions(problem, sol),
                            largest_at_peak(problem.graph, ops, inputs), self.memory_limit,
                            written_time=problem.written(ops, inputs))

    def _decisions(self, problem: Problem, sol) -> list:
        """For each matmul/conv decision: the chosen strategy, and the best other one
        with every other decision kept (the plan's modeled time with it instead)."""
        out = []
        base = problem.objective(sol.choice)
        memory = _Liveness(problem.graph, problem) if self.memory_limit is not None else None
        counts: dict = {}
        for n in problem.nodes:
            counts[n.template] = counts.get(n.template, 0) + 1
        for n in problem.nodes:
            if n.template != n.index or n.is_input or n.root.kind not in DECIDERS:
                continue
            t = n.index
            k = sol.choice[t]
            best = None
            # the plan with only this decision changed: its own cost and its edges' differ
            delta = problem.switch_deltas(sol.choice, t)
            for j in np.argsort(delta, kind="stable"):
                if j != k:
                    best = (base + float(delta[j]), int(j))
                    break
            op = n.root
            where = f"{op.kind} at {op.source}" if op.source else op.kind
            chosen = _words(n.strategies[k][0], op, problem.mesh)
            if best is None:
                out.append(Alternative(where, counts[t], chosen, base, None, None))
                continue
            trial = dict(sol.choice)
            trial[t] = best[1]
            peak = memory.peak(trial)[0] if memory is not None else None
            out.append(Alternative(where, counts[t], chosen, base, _words(n.strategies[best[1]][0], op, problem.mesh),
                                   best[0], peak))
        return out

    def _overflow(self, problem: Problem, met=None, out_of_time: Optional[str] = None) -> ShardingError:
        """No plan fits: the smallest peak found (each decision at its fewest bytes, or
        ``met``: a plan the memory rounds met, (peak, choice)) and the tensors that make it.
        ``out_of_time``: the budget ran out before any plan that fits (the solver's words),
        which does not prove there is none."""
        memory = _Liveness(problem.graph, problem)
        choice = {}
        for t in problem.unary:
            totals = sum((vec for tt, vec in problem.values.values() if tt == t), np.zeros(len(problem.unary[t])))
            choice[t] = int(np.argmin(totals))
        if met is not None and met[0] < memory.peak(choice)[0]:
            choice = met[1]
        peak, at = memory.peak(choice)
        biggest = memory.largest(choice, at, 5)
        names = "; ".join(f"{name} {shape} ({nbytes / 2**20:.2f} MiB per device)" for name, shape, nbytes in biggest)
        head = f"no plan fits memory_limit={self.memory_limit:,} bytes per device on mesh {problem.mesh}"
        more = ""
        if out_of_time is not None:
            head = (f"the search found no plan under memory_limit={self.memory_limit:,} bytes per device on mesh "
                    f"{problem.mesh} within its time budget{'' if self.time_budget is None else f' of {self.time_budget:g} s'} "
                    f"({out_of_time})")
            more = "give the search more time (parallelize(..., search_seconds=...)), "
        return NoPlanFits(
            f"{head}: the smallest modeled peak found is {peak:,.0f} bytes per device ({peak / 2**20:.2f} MiB); the "
            f"largest tensors alive there: {names}. Fix: {more}raise memory_limit, use more devices, or shrink the "
            f"batch or the model", float(peak))


def _loop_bodies(graph: Graph, bodies: PropagateSharding) -> dict:
    """The moves the loop and branch bodies of ``graph`` make as planned (``bodies``: the
    propagation that planned them): {"communication": seconds, "bytes": sent} per device
    per step, a scan's body once per trip (a while's trip count is unknown: once; each
    branch of a cond), as ``cost.modeled_step_time`` counts a lowered program's
    collectives. The objective prices a loop by its summary rule and its boundary only:
    on a scanned MLP step, plan.cost had reported no bytes moved for a plan whose
    backward body gathers on every trip (bench/scan_layers.py)."""
    out = dict(communication=0.0, bytes=0.0)

    def walk(g: Graph, times: int) -> None:
        for op in g.ops:
            n = times * trips(op)
            for body in op.subgraphs:
                e = evaluate_written(bodies.context(body), bodies.prices, bodies.compute_times_of(body))
                out["communication"] += n * e["communication"]
                out["bytes"] += n * e["bytes"]
                walk(body, n)
    walk(graph, 1)
    return out


def _cannot_beat(bound: Optional[float], plan: Optional[float]) -> bool:
    """Whether a lower bound proves that no plan under it beats ``plan`` (seconds; either
    None: nothing is proven)."""
    return bound is not None and plan is not None and bound >= plan * (1 - 1e-9)


def _warm_model(problem: Problem, memory: "_Liveness", fams: list):
    """The problem's LP as one warm-started model (``warm_lp.py``), built once per problem
    (kept across the searches of one compile: ``memo.py``), its reduction keeping each hand family's
    candidates; None without HiGHS's bindings."""
    if not warm_lp.available():
        return None
    key = (problem.fingerprint, memory.signature())
    model = memo.WARM_MODELS.get(key)
    if model is None:
        red = milp.reduce(problem, memory_matters=True, also=[f.allowed for f in fams if f.allowed is not None])
        model = warm_lp.WarmLP(red)
        memo.remember(memo.WARM_MODELS, key, model, memo.WARM_MODELS_MAX)
    return model


def _origin(graph: Graph, op, root) -> tuple:
    """(origin words, the op they name) of ``op`` in the searched plan, its node's root
    ``root`` (``plan_core.write``): what the user fixed stays the user's."""
    if user_fixed(op):
        return USER, None
    if op.kind in FIXED and isinstance(op.origin, str) and op.origin.startswith(USER):
        return op.origin, None   # a shard_map's specs
    if op is root:
        return SEARCHED, None
    if isinstance(root, int):
        return follows_input(graph, root), None
    return follows(root), root


def _words(st, op, mesh) -> str:
    ins = tuple(st.operand_layout(m, v.type.rank, mesh).splits(mesh) for m, v in enumerate(op.inputs))
    axes = ", ".join("{" + ",".join(a) + "}" for a in st.factors)
    return f"{ins} factors [{axes}]"


def _roundings(lp, rows: list, memory: "_Liveness", limit: float, tries: int = 3, problem=None) -> list:
    """Plans from a fractional LP under memory rows: each decision to its heaviest
    candidate, then, where that is over the limit, more and more of the fractional
    decisions to the candidate the LP weighs that holds the fewest bytes in the rows;
    the first prefix that fits (bisected: the bytes fall as it grows) and the ``tries``
    - 1 after it. Two orders of switching: the most weighted first, and (given the
    ``problem``) the cheapest per byte saved first: what the switch adds to the
    heaviest plan's time over the bytes it takes off the rows (where the LP weighs
    two whole plans alike on every decision, the weights say nothing about which to
    switch, and that order switched far more than the limit needs)."""
    heavy, switch = {}, []
    for t, (cands, w) in lp.support.items():
        h = int(cands[int(np.argmax(w))])
        heavy[t] = h
        held = sum((row.nodes[t][cands] for row in rows if t in row.nodes), np.zeros(len(cands)))
        lean = int(np.argmin(held - 1e-9 * w))   # (ties: the heavier)
        if int(cands[lean]) != h and held[lean] < held[int(np.argmax(w))]:
            switch.append((-float(w[lean]), t, int(cands[lean]), float(held[int(np.argmax(w))] - held[lean])))
    switch.sort(key=lambda s: (s[0], s[1]))

    def plan(order, j: int) -> dict:
        choice = dict(heavy)
        for _, t, k, _ in order[:j]:
            choice[t] = k
        return lp.complete(choice)
    out = [plan(switch, 0)]
    if not switch or memory.peak(out[0])[0] <= limit:
        return out
    orders = [switch]
    if problem is not None:
        base = out[0]
        orders.append(sorted(switch, key=lambda s: (_switch_cost(problem, base, s[1], s[2]) / s[3], s[1])))
    for order in orders:
        lo, hi = 0, len(order)   # plan(lo) is over; find the first j that fits
        if memory.peak(plan(order, hi))[0] > limit:
            out.append(plan(order, hi))
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if memory.peak(plan(order, mid))[0] <= limit:
                hi = mid
            else:
                lo = mid
        out += [plan(order, j) for j in range(hi, min(hi + tries, len(order) + 1))]
    return out


def _dive(lp, warm, red, rows: list, limit: float, deadline: Optional[float], problem, share: float = 0.5,
          fits=None, incumbent: Optional[tuple] = None, tolerance: float = DIVE_STOP,
          enough: Optional[float] = None, polish: float = 0.0):
    """LP diving, from the memory side, until the LP is integral: a plan that meets the
    rows, or None (out of time, or nothing left to fix). While the LP's heaviest plan
    (each decision at the candidate it weighs most) is over a row, the fractional
    decisions whose leanest candidate the LP weighs (the fewest bytes in the rows)
    saves bytes most cheaply (``_switch_cost`` against that plan, per byte) are fixed to
    it, as many as cover the excess; once it is not, the half (``share``) it is surest of are
    fixed to their heaviest candidate. The LP is solved again from its last basis after
    each batch; a batch that leaves it infeasible is halved, a single one skipped.

    ``fits(choice)``: whether a plan fits the limit (its modeled peak, not the rows
    alone). Given it, the dive keeps the cheapest heaviest plan that fits among the LPs
    it solves (``incumbent``: (time, choice) of a plan that fits to start from, a
    rounding), returns that where it runs out of time or fixings, and stops once the
    LP's bound (which every fixing can only raise) is within ``tolerance`` of it: no
    plan further down can be cheaper by more than that. The plan returned is the
    cheaper of the incumbent and the integral plan the dive ends at. ``enough``: a time
    at which a plan is good enough (proven within the search's gap by the root LP's
    bound): once the incumbent is at most that, the dive goes on for at most ``polish``
    seconds."""
    fixed: dict = {}
    skip: set = set()
    cur = lp
    best = incumbent

    def consider(sol):
        nonlocal best
        if fits is None:
            return
        choice = sol.complete(sol.choice)
        t = problem.objective(choice)
        if (best is None or t < best[0]) and fits(choice):
            best = (t, choice)
    consider(cur)
    while cur.rounded:
        if best is not None and best[0] <= cur.bound * (1 + tolerance):
            return best[1]   # (the dive cannot find a plan cheaper than the incumbent by more than that)
        if enough is not None and best is not None and best[0] <= enough:
            polished = time.perf_counter() + polish
            deadline = polished if deadline is None else min(deadline, polished)
            enough = None   # (the polish is counted from the first plan good enough)
        if deadline is not None and time.perf_counter() >= deadline:
            return best[1] if best is not None else None
        base = cur.complete(cur.choice)
        over = max(sum(float(vec[base[t]]) for t, vec in row.nodes.items()) for row in rows) - limit if rows else 0.0
        lean, sure = [], []
        for t, (cands, w) in cur.support.items():
            if t in fixed or t in skip or len(cands) < 2:
                continue
            held = sum((row.nodes[t][cands] for row in rows if t in row.nodes), np.zeros(len(cands)))
            i = int(np.argmax(w))
            sure.append((-float(w[i]), t, int(cands[i]), 0.0))
            j = int(np.argmin(held - 1e-9 * w))
            saved = float(held[i] - held[j])
            if int(cands[j]) != base[t] and saved > 0:
                lean.append((_switch_cost(problem, base, t, int(cands[j])) / saved, t, int(cands[j]), saved))
        if over > 0 and lean:
            lean.sort()
            cover = np.searchsorted(np.cumsum([f[3] for f in lean]), over) + 1
            batch = lean[:max(1, min(int(cover), len(lean)))]
        elif sure:
            sure.sort()
            batch = sure[:max(1, int(np.ceil(share * len(sure))))]
        else:
            return best[1] if best is not None else None
        while True:
            trial = dict(fixed)
            trial.update({t: k for _, t, k, _ in batch})
            left = None if deadline is None else max(deadline - time.perf_counter(), 0.5)
            nxt = warm.solve({**red.kept, **{t: np.array([k]) for t, k in trial.items()}}, rows, limit, left)
            if nxt.choice or len(batch) == 1 or getattr(nxt, "timed_out", False):
                break
            batch = batch[:len(batch) // 2]
        if not nxt.choice:
            if getattr(nxt, "timed_out", False):
                return best[1] if best is not None else None
            skip.add(batch[0][1])
            continue
        fixed, cur = trial, nxt
        consider(cur)
    return best[1] if best is not None else cur.choice   # (the integral plan, where it fits, was considered)


def _switch_cost(problem: Problem, choice: dict, t: int, k: int) -> float:
    """What the plan ``choice`` gains in modeled time with decision ``t`` at candidate
    ``k`` instead (its own cost and its edges' against its neighbours' choices)."""
    return float(problem.switch_deltas(choice, t)[k])


class _Best:
    """The cheapest plan that fits among those the parts of a search under a limit
    offer (the LP rounds, the multipliers, the exact rows), and how it was found."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.choice, self.time, self.how, self.part = None, float("inf"), "", ""
        self.rounds, self.size = 0, (0, 0)   # solves so far; the last model's variables and binaries
        self.beaten: list = []   # the plans it replaced, in words

    def offer(self, choice: dict, part: str, how: str) -> bool:
        """Keep ``choice``, found by ``part`` (``how``: in words), if it is cheaper than
        the plan kept so far (whether it is)."""
        t = self.problem.objective(choice)
        if t >= self.time * (1 - 1e-12):
            return False
        if self.choice is not None:
            self.beaten.append(f"cheaper than {self.part}' plan ({self.time * 1e3:.4f} ms)")
        self.choice, self.time, self.how, self.part = choice, t, how, part
        return True

    def gap(self, bound: float) -> float:
        return max(0.0, (self.time - bound) / self.time) if self.time > 0 else 0.0

    def solution(self, bound: float, notes: list, seconds: float) -> milp.Solution:
        sol = milp.Solution(self.choice, self.time, bound, self.gap(bound), "; ".join([self.how] + self.beaten + notes),
                            seconds, *self.size)
        sol.rounds = self.rounds
        return sol


class _Liveness:
    """Modeled live bytes per program point of a choice (``memory.plan_profile``: values
    and redistribution copies), and the constraint of one point."""

    def __init__(self, graph: Graph, problem: Problem):
        self.facts = program_facts(graph)   # (the program's part of every peak: computed once)
        intervals, self.shadows, fused, _ = self.facts
        self.fused = [(r, m, p) for (r, m), p in fused.items()]
        self.graph, self.problem = graph, problem
        self.vals = [v for v in problem.values if v in intervals]
        self.birth = np.array([intervals[v][0] + 1 for v in self.vals])
        self.death = np.array([intervals[v][1] + 1 for v in self.vals])
        self.temp = [problem.values[v][0] for v in self.vals]
        self.vec = [problem.values[v][1] for v in self.vals]
        self._copies: dict = {}
        self._held_terms = self._copy_terms()
        self._held_bytes: dict = {}   # a copy's bytes by value type, kind and layout classes

    def signature(self) -> tuple:
        """What the rows depend on beyond the problem: the program and when each value lives."""
        return len(self.graph.ops), self.birth.tobytes(), self.death.tobytes()

    def bytes_of(self, choice: dict) -> np.ndarray:
        return np.array([vec[choice[t]] for t, vec in zip(self.temp, self.vec)])

    def peak(self, choice: dict) -> tuple[float, int]:
        prof = self.profile(choice)
        at = int(np.argmax(prof))
        return float(prof[at]), at

    def profile(self, choice: dict) -> np.ndarray:
        """``memory.plan_profile`` of ``choice``: each value's bytes over its live interval,
        and each copy's (what ``row`` sums at one point) over the points it is held,
        looked up by the choice's layout classes rather than by walking the program with
        its strategies (4-5x faster on the GPT steps, where the search, its hand plans
        made to fit and its dives take 100-200 peaks: 18 against 4 ms at 2 layers, 90
        against 22 at 12). Where a mark's request gathers a stored value, which each
        reader then gathers at its own use (``plan_buffers``), the walk itself."""
        if self._held_terms is None:
            return plan_profile(self.graph, *self.problem.op_strategies(choice), self.facts)
        n = len(self.graph.ops)
        diff = np.zeros(n + 3)
        b = self.bytes_of(choice)
        np.add.at(diff, self.birth, b)
        np.add.at(diff, self.death + 1, -b)
        for term in self._held_terms:
            x = self._term_bytes(term, choice)
            diff[term[0]] += x
            diff[term[1] + 1] -= x
        return np.cumsum(diff)[:n + 2]

    def switched(self, choice: dict, prof: np.ndarray, t: int, k: int) -> np.ndarray:
        """``profile`` of ``choice`` with decision ``t`` at candidate ``k``, from ``prof``
        (``choice``'s own): only the values ``t`` makes and the copies it is an end of
        change (``repair.py`` tries single switches by the hundred: 44 ms a whole profile
        at 12 layers). Bytes are whole numbers, so the sum is the whole profile's exactly."""
        if choice[t] == k:
            return prof
        if self._held_terms is None:   # (the walk: ``profile``)
            return self.profile({**choice, t: k})
        vals, terms = self._by_template.get(t, ((), ()))
        n = len(self.graph.ops)
        diff = np.zeros(n + 3)
        was = choice[t]
        for i in vals:
            d = self.vec[i][k] - self.vec[i][was]
            diff[self.birth[i]] += d
            diff[self.death[i] + 1] -= d
        trial = {**choice, t: k}
        for j in terms:
            term = self._held_terms[j]
            d = self._term_bytes(term, trial) - self._term_bytes(term, choice)
            diff[term[0]] += d
            diff[term[1] + 1] -= d
        return prof + np.cumsum(diff)[:n + 2]

    @functools.cached_property
    def _by_template(self) -> dict:
        """template -> (indices of the values it makes, of the copy terms it is an end of)."""
        vals: dict = {}
        terms: dict = {}
        for i, t in enumerate(self.temp):
            vals.setdefault(t, []).append(i)
        for j, (_, _, ta, tb, *_) in enumerate(self._held_terms):
            terms.setdefault(ta, []).append(j)
            if tb != ta:
                terms.setdefault(tb, []).append(j)
        return {t: (vals.get(t, ()), terms.get(t, ())) for t in set(vals) | set(terms)}

    def _term_bytes(self, term: tuple, choice: dict) -> float:
        """Bytes a copy term (``_copy_terms``) holds under ``choice``, memoized by its
        value's type and its layout classes."""
        _, _, ta, tb, src, dst, v, held = term
        ca, cb = src.index[choice[ta]], dst.index[choice[tb]]
        key = (v.type, held, src.ident, dst.ident, ca, cb)
        x = self._held_bytes.get(key)
        if x is None:
            x = self._held_bytes[key] = held(v, src.layouts[ca], dst.layouts[cb], self.problem.mesh)
        return x

    def _copy_terms(self) -> Optional[list]:
        """(first point, last point, producer's template, consumer's template, layout
        classes made, classes needed, value, bytes held) of every copy a plan may hold:
        at each op, of its operands; over a view's shadow; over a fused value's span. None
        where a mark's request reads a stored value (``profile``)."""
        stored = self.facts[3]
        if any(op.kind == CONSTRAINT and op.inputs and op.inputs[0] in stored for op in self.graph.ops):
            return None
        ops = self.graph.ops
        out = [(at, at) + r + (copy_bytes,) for at, op in enumerate(ops, start=1) for r in self._reads(op)]
        out += [(b + 1, d + 1) + r + (view_bytes,) for q, (b, d) in self.shadows.items() for r in self._reads(ops[q])]
        out += [(q + 1, r + 1) + x + (fused_bytes,) for r, m, q in self.fused for x in self._reads(ops[r], only=m)]
        return out

    def _reads(self, op, only=None) -> list:
        """(producer's template, consumer's template, layout classes made, classes needed,
        value) of each operand of ``op`` a decision makes (``only``: that operand alone)."""
        p = self.problem
        if op not in p.node_of_op:
            return []
        ci, pc = p.node_of_op[op]
        cnode = p.nodes[ci]
        out = []
        for m, v in enumerate(op.inputs):
            if v.literal is not None or v not in p.owner or (only is not None and m != only):
                continue
            pnode = p.nodes[p.owner[v][0]]
            out.append((pnode.template, cnode.template, p._classes_made(v, pnode),
                        p._classes_needed(v, cnode, pc, m), v))
        return out

    def row(self, at: int) -> milp.MemoryRow:
        """The bytes alive at program point ``at``, per candidate: the values, and the
        copies the op there makes of its operands."""
        out: dict = {}
        live = np.nonzero((self.birth <= at) & (self.death >= at))[0]
        for i in live:
            t = self.temp[i]
            out[t] = out[t] + self.vec[i] if t in out else self.vec[i].copy()
        row = milp.MemoryRow(out, point=at)
        terms = self.copies(self.graph.ops[at - 1]) if 1 <= at <= len(self.graph.ops) else []
        for p, (b, d) in self.shadows.items():       # views whose buffer is alive anyway
            if b + 1 <= at <= d + 1:
                terms = terms + self.copies(self.graph.ops[p], view_bytes)
        for r, m, p in self.fused:      # fused values whose reader needs them in another layout
            if p + 1 <= at <= r + 1:
                terms = terms + self.copies(self.graph.ops[r], fused_bytes, only=m)
        for term in terms:
            if len(term) == 2:
                t, vec = term
                out[t] = out[t] + vec if t in out else vec.copy()
            else:
                row.pairs.append(term)
        return row

    def copies(self, op, held=copy_bytes, only=None) -> list:
        """The copies redistributing ``op``'s operands makes (``held``: the bytes one
        holds, from the operand, its layout and the one needed): (template, bytes per
        candidate) where one decision fixes both layouts, else (producer's template,
        consumer's template, classes, classes, bytes by class pair)."""
        mesh = self.problem.mesh
        out = []
        for pt, ct, src, dst, v in self._reads(op, only):
            key = (pt, ct, src.ident, dst.ident, src.index.tobytes(), dst.index.tobytes(), v.type, held)
            term = self._copies.get(key)
            if term is None:
                if pt == ct:
                    term = (ct, np.array([held(v, src.layouts[a], dst.layouts[b], mesh)
                                          for a, b in zip(src.index, dst.index)]))
                else:
                    term = (pt, ct, src.index, dst.index,
                            np.array([[held(v, a, b, mesh) for b in dst.layouts] for a in src.layouts]))
                self._copies[key] = term
            out.append(term)
        return out

    def largest(self, choice: dict, at: int, n: int) -> list:
        b = self.bytes_of(choice)
        live = [i for i in np.nonzero((self.birth <= at) & (self.death >= at))[0]]
        live.sort(key=lambda i: -b[i])
        g = self.problem.graph
        names = {v: (g.input_names[i] if i < len(g.input_names) else f"input {i}") for i, v in enumerate(g.inputs)}
        out = []
        for i in live[:n]:
            v = self.vals[i]
            out.append((names.get(v, f"a {v.type.dtype} value"), tuple(v.type.shape), float(b[i])))
        return out
