"""The hand plans the factor structure implies, as plans of the search's own problem.

A hand plan is named by how it stores the step's arguments: the batch split over the
data-parallel axes, and the weights (read by a matmul/conv) and the rest of the state
(returned in place of an argument: optimizer moments) replicated (DP), the state
split over the data-parallel axes (ZeRO-1), weights and state split over them and
gathered where a matmul reads them (FSDP / ZeRO-3), weights split over the model
axes (Megatron: a matmul pair's column then row split is what the solver picks for
its ops), or over both (tp+FSDP). On a mesh of two axes each axis takes each role.
Every other decision (each op's strategy) is then the best the problem's solver
finds for those storage layouts, so each plan here is at least as good, under the
model, as the hand plan of that name (where that plan is over the memory limit, it is
made to fit by switching decisions at its peak to leaner candidates, ``repair.py``:
then it fits, but is not the optimum under the limit); each is priced by the one evaluator, twice:
as the solver's objective prices it (``Problem.evaluate``: a copy once per reader)
and as the program is written (``Problem.written``: a copy several ops read made
once, the price propagation gives the same plan), and its modeled peak
(``memory.plan_profile``).

The search starts from the best of them that fits: its objective bounds which
candidates are searched at all, and the search never returns a plan priced, as
written, above the best one's written price (``search.py``). ``plan.explain()``
lists them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...ir.errors import ShardingError

from ..cost import IMPOSSIBLE
from . import memo, milp
from .problem import DECIDERS

# what each role is split over, per family: "dp" the data-parallel axes, "mp" the model
# axes, "dp+mp" both, "none" replicated (a weight no such split divides: the search's
# choice)
FAMILIES = (
    ("DP", dict(batch="dp", params="none", state="none")),
    ("ZeRO-1", dict(batch="dp", params="none", state="dp")),
    ("FSDP", dict(batch="dp", params="dp", state="dp")),
    ("Megatron", dict(batch="dp", params="mp", state="mp")),
    ("tp+FSDP", dict(batch="dp", params="dp+mp", state="dp+mp")),
)


# seconds a hand plan's dive (with a warm model) or MILP (without one) may take where its LP's
# optimum is fractional (and the family could be the best hand plan): a hand plan is a plan to
# beat, not the search. On the 2-layer
# GPT step on 4 x 2 one family's branch and bound ran past 140 s; cut at 10 s, the families'
# plans were 1.05-4.9x their LP's roundings, and on 2 x 4 at 0.5 the one family that needed it
# found none cheaper than its rounding in 10 s (the small steps of the tests prove theirs in
# well under a second)
HAND_MILP_S = 3.0
# a fractional family gets branch and bound only where the warm model's first, cold LP solve
# took under this: branch and bound starts with such a solve (its root) and needs room to
# branch. Else (the GPT steps: 1-2 s) the dive on the warm LP: within HAND_MILP_S branch and
# bound never beat the rounding on the 2- and 48-layer GPT steps, where one warm solve
# of the dive found plans 20-22% under it (48 layers on 4 x 2 at 0.7); on small steps it
# proves the optimum in well under a second (the dive: 16% above it on an Adam step)
BRANCH_ROOT_S = HAND_MILP_S / 10

# a family's LP is given up once its bound passes the best hand plan that fits, as written,
# over this: no plan of the family is then within reach of that plan. The objective prices
# a copy once per reader, the program makes it once, so a plan is cheaper as written than
# its objective: the hand plans of the 2-layer GPT step on 4 x 2 are 0.87-0.99 of theirs.
# In its search at 0.9 of the free peak, four of its seven families' LPs passed this
# (ZeRO-1's 20.45 ms over 0.85) in 1.39 s in all, where their optima had taken 3.30 s
WRITTEN_SHARE = 0.85

BATCH_NAMES = {"x", "xs", "inputs", "batch", "tokens", "targets", "y", "labels", "images", "ids"}


@dataclass
class HandPlan:
    name: str                       # "FSDP"
    axes: str                       # "dp over a, mp over b"
    time: Optional[float] = None    # modeled step (seconds), by the one evaluator (the objective's)
    written: Optional[float] = None  # the same plan as insert-reshards writes it (a copy several ops read, once)
    peak: Optional[float] = None    # modeled peak bytes per device
    fits: bool = False
    choice: Optional[dict] = None
    note: str = ""
    allowed: Optional[dict] = field(default=None, repr=False)   # its family's narrowing (the solves under a limit)
    key: Optional[tuple] = field(default=None, repr=False)       # what its solve under the limit is cached by
    lp: Optional[object] = field(default=None, repr=False)       # a fractional LP solution, its MILP not yet run

    @property
    def label(self) -> str:
        """What names this plan among a compile's hand plans (``SearchStrategies(pick=)``)."""
        return f"{self.name} {self.axes}"

    def __str__(self):
        if self.time is None:
            return f"{self.name:<9} {self.axes:<24} n/a: {self.note}"
        fits = "fits" if self.fits else "over the limit"
        written = f" ({self.written * 1e3:.4f} ms as written)" if self.written is not None else ""
        return (f"{self.name:<9} {self.axes:<24} step {self.time * 1e3:.4f} ms{written}, peak "
                f"{self.peak / 2**20:.2f} MiB per device ({fits})")


def roles(problem) -> dict:
    """Input index -> "batch", "params", "state" or None (a scalar, a step count)."""
    g = problem.graph
    tied = set(g.tied_outputs.values())
    users = problem.ctx.users

    def read_by_matmul(v, depth=2):
        for u in users.get(v, ()):
            if u.kind in DECIDERS:
                return True
            if depth > 1 and len(u.outputs) == 1 and u.outputs[0].type.rank == v.type.rank and \
                    read_by_matmul(u.outputs[0], depth - 1):
                return True
        return False
    names = list(g.input_names) + [f"arg{i}" for i in range(len(g.input_names), len(g.inputs))]

    def root(name):
        return name.split("[")[0].split(".")[0]
    # a forward step: the arguments a model's batch is usually called, else the last one
    # (as mode="data_parallel" takes it)
    given = {root(n) for n in names} & BATCH_NAMES
    last = root(names[len(g.inputs) - 1]) if g.inputs else None
    out = {}
    for i, v in enumerate(g.inputs):
        if v.type.rank == 0:
            out[i] = None
        elif tied:
            out[i] = ("params" if read_by_matmul(v) else "state") if i in tied else "batch"
        elif root(names[i]) in given or (not given and root(names[i]) == last):
            out[i] = "batch"
        else:
            out[i] = "params" if read_by_matmul(v) else None
    return out


def _fits_role(layout, kind: str, dp: tuple, mp: tuple, batch: bool) -> bool:
    used = set(layout.used_axes())
    if layout.partial:
        return False
    if kind == "none":
        return not used
    if kind == "mp":
        return used == set(mp)
    if kind == "dp+mp":
        return used == set(dp) | set(mp)
    # "dp": exactly the data-parallel axes; the batch on its leading dim
    if used != set(dp):
        return False
    return not batch or set(layout.dims[0]) == set(dp)


def assignments(mesh) -> list[tuple[tuple, tuple]]:
    """(data-parallel axes, model axes): all axes data parallel, all model parallel, and
    on a mesh of two axes each taking each role."""
    names = tuple(mesh.axis_names)
    out = [(names, ()), ((), names)]
    if len(names) == 2:
        a, b = names
        out += [((a,), (b,)), ((b,), (a,))]
    return out


@dataclass
class Family:
    """One hand plan to solve: its name, the mesh axes' roles, and the candidates its
    storage layouts leave each argument's decision (None, with ``note``, where it does
    not apply)."""
    name: str
    axes: str
    allowed: Optional[dict]
    note: str = ""


def families(problem) -> list[Family]:
    """Every family x axis assignment that applies (Megatron and tp+FSDP need model
    axes; a batch that no data-parallel split divides keeps the search's choice),
    without repeats: what each leaves each argument's decision."""
    g = problem.graph
    role = roles(problem)
    if "batch" not in role.values():
        return []
    templates = {}
    for i, v in enumerate(g.inputs):
        if v in problem.owner:
            ni = problem.owner[v][0]
            templates[i] = problem.nodes[ni].template
    out, seen = [], set()
    for dp, mp in assignments(problem.mesh):
        axes = ", ".join(([f"dp over {','.join(dp)}"] if dp else []) + ([f"mp over {','.join(mp)}"] if mp else []))
        for name, kinds in FAMILIES:
            if ("mp" in kinds["params"]) != bool(mp) or not (dp or mp):
                continue
            if not dp and kinds["params"] != "mp":   # (with no dp axes: Megatron alone)
                continue
            allowed: dict = {}
            bad = None
            for i, r in role.items():
                if r is None or i not in templates:
                    continue
                t = templates[i]
                node = problem.nodes[t]
                # a vector (a bias, a norm's scale) may also stay whole: an engineer splits
                # the matrices and keeps those replicated (splitting them saves next to no
                # bytes and adds a gather per use)
                kind_of = (kinds[r], "none") if r != "batch" and g.inputs[i].type.rank <= 1 else (kinds[r],)
                ok = np.array([k for k, lay in enumerate(node.candidates)
                               if any(_fits_role(lay, kd, dp, mp, r == "batch") for kd in kind_of)], dtype=int)
                if not len(ok):
                    if r == "batch":
                        bad = f"{g.input_names[i] if i < len(g.input_names) else i} does not split over {dp}"
                        break
                    continue   # (a weight no split divides: the search's choice)
                allowed[t] = ok if t not in allowed else np.intersect1d(allowed[t], ok)
            if bad is None and any(len(a) == 0 for a in allowed.values()):
                bad = "two arguments that share a decision take different roles"
            if bad is not None:
                out.append(Family(name, axes, None, bad))
                continue
            key = tuple(sorted((t, tuple(a)) for t, a in allowed.items()))
            if key in seen:
                continue
            seen.add(key)
            out.append(Family(name, axes, allowed))
    return out


def hand_plans(problem, peak_of, limit: Optional[float], time_limit: Optional[float] = 10.0,
               fams: Optional[list] = None, warm=None, fit=None, every: bool = False,
               margin: float = 0.0, dive=None) -> list[HandPlan]:
    """Each of ``families(problem)`` (or ``fams``) solved for its storage layouts and
    priced. ``peak_of(choice)``: its modeled peak. ``warm``: a ``warm_lp.WarmLP`` of
    this problem whose reduction kept every family's candidates (``milp.reduce(...,
    also=)``): each family is then its LP narrowed by bounds, solved from the last
    family's basis (where its optimum is fractional, the MILP from scratch).

    ``fit(allowed, choice)``: a plan of the family narrowed to ``allowed`` that fits
    the limit, solved under it, where its time-optimal ``choice`` does not (or None).
    An engineer's plan of that name gathers each weight at its use and frees it after;
    solved for time alone, the family's ops may hold far more (tp+FSDP on the 2-layer
    GPT step on 4 x 2 modeled 4.59 MB against a 2.54 MB limit, while the engineer's
    fits), and the search, which returns nothing worse than the best hand plan that
    fits, would have none to hold to. ``every``: each family over the limit is solved
    under it, not only those that could be the best that fits (a hand plan picked by
    name, which measure=True times, must be there whatever the others cost). ``margin``:
    a family whose LP optimum is fractional gets branch and bound only where its LP's
    bound is more than this fraction below the best hand plan that fits (the search's
    own tolerance, ``relaxed_gap``: a plan it would keep may lie that far above its
    bound, so a family that could beat the best hand plan by less adds nothing it
    would not find). ``dive(allowed, lp, rounding)``: where a cold LP of this problem
    is too slow for branch and bound to get anywhere in ``HAND_MILP_S`` (``BRANCH_ROOT_S``),
    the fractional LP dived to an integral plan on the warm model (``search._dive``)
    instead, the cheaper of its plan and the rounding kept.

    Under a limit, once a plan that fits is solved, a later family's warm LP is given up
    where its bound passes that plan's written price over ``WRITTEN_SHARE``: no plan of
    it could be the best, and its optimum is not worth the search's time. It is listed
    with no plan, its note saying so."""
    fams = families(problem) if fams is None else fams
    solved: dict = {}   # family index -> its plan, solved in the warm LP's order
    written = None      # the least written price of a plan solved so far that fits
    for k in _warm_order(problem, fams):
        fam = fams[k]
        if fam.allowed is None:
            solved[k] = HandPlan(fam.name, fam.axes, note=fam.note)
            continue
        name, axes, allowed = fam.name, fam.axes, fam.allowed
        floor = _arguments_floor(problem, allowed)
        if limit is not None and floor > limit:   # (arguments are alive the whole step: no solve can fit it)
            solved[k] = HandPlan(name, axes, peak=floor, note=f"over the limit: its arguments alone hold "
                                                              f"{floor / 2**20:.2f} MiB per device")
            continue
        key = tuple(sorted((t, tuple(a)) for t, a in allowed.items()))
        # (under a limit only, where the search's time counts: without one the hand plans are
        # what explain() compares with; and every one is wanted where one is picked by name)
        cutoff = written / WRITTEN_SHARE if written is not None and limit is not None and not every else None
        plan = _solve(problem, name, axes, allowed, peak_of, limit, time_limit, (problem.fingerprint, key), warm,
                      exact=False, cutoff=cutoff)
        plan.allowed, plan.key = allowed, (problem.fingerprint, key, limit)
        solved[k] = plan
        if plan.fits and plan.written is not None and (written is None or plan.written < written):
            written = plan.written
    out = [solved[k] for k in range(len(fams))]   # (listed in the families' order)
    fractional = [i for i, plan in enumerate(out) if plan.lp is not None]
    if fit is not None:
        out = _fit_cheapest(problem, out, fit, peak_of, limit, every)
    # the families whose LP optimum is fractional, least LP bound first, against the best hand
    # plan that fits (the others made to fit included): branch and bound (up to HAND_MILP_S
    # each) only where the family could beat that plan by more than ``margin``; the others keep
    # the LP's rounding (on the 2-layer GPT step on 2 x 4 at 0.7, three families each ran their
    # MILP 19-27 s to plans 1.6-7.8x the best hand plan's, whose time their LP bounds were
    # already above; on 4 x 2 at 0.7 two whose bounds were 0.03% and 1.4% below it each spent
    # their 3 s and kept their roundings, 1.2x and 1.4x it)
    for i in sorted(fractional, key=lambda i: out[i].lp.bound):
        p, least = out[i], bound(out)
        if not every and (least is None or p.lp.bound >= least * (1 - max(margin, 1e-12))):
            why = "no hand plan fits to weigh it against" if least is None else \
                f"its LP's bound {p.lp.bound * 1e3:.4f} ms is " + \
                ("no less than" if p.lp.bound >= least * (1 - 1e-12) else f"at most {margin:.0%} below") + \
                f" the best hand plan that fits ({least * 1e3:.4f} ms)"
            out[i] = _rounded(problem, p, peak_of, limit, why)
        elif dive is not None and warm is not None and (warm.cold_seconds() or 0.0) >= BRANCH_ROOT_S:
            out[i] = _dived(problem, p, dive, peak_of, limit)
        else:   # (the LP already solved is handed on, not solved again)
            out[i] = _solve(problem, p.name, p.axes, p.allowed, peak_of, limit, time_limit, p.key[:2], warm, lp=p.lp)
            out[i].allowed, out[i].key = p.allowed, p.key
        if fit is not None:
            out = _fit_cheapest(problem, out, fit, peak_of, limit, every, among=(i,))
    kept: list = []
    for plan in out:
        same = next((p for p in kept if p.choice is not None and p.choice == plan.choice), None)
        if same is not None:   # (tp+FSDP that splits nothing over dp is Megatron)
            same.name += f" = {plan.name}" if plan.name not in same.name else ""
            continue
        kept.append(plan)
    return kept


def _warm_order(problem, fams: list) -> list:
    """The order to solve ``fams`` in on one warm LP: from the first (DP, which narrows
    least), each next the family whose narrowing is nearest the last one's (the fewest
    decisions' candidate sets changed, by Jaccard distance). The dual simplex goes on
    from the last family's basis, so its pivots grow with how far the bounds move: on
    the 2-layer GPT step on 2 x 4 the eight families' LPs took 12.9 s in the families'
    order and 9.3 s in this one, the params-split families 0.1-0.4 s each after their
    first, against 8-10 s each from nothing."""
    todo = [k for k, f in enumerate(fams) if f.allowed is not None]
    order = [k for k, f in enumerate(fams) if f.allowed is None]
    if not todo:
        return order

    def candidates(fam, t) -> set:   # (a decision the family leaves alone: all of them)
        return set(fam.allowed[t].tolist()) if t in fam.allowed else set(range(len(problem.unary[t])))

    def distance(a, b) -> float:
        out = 0.0
        for t in set(a.allowed) | set(b.allowed):
            ca, cb = candidates(a, t), candidates(b, t)
            out += 1.0 - len(ca & cb) / max(len(ca | cb), 1)
        return out
    last = todo.pop(0)
    order.append(last)
    while todo:
        last = min(todo, key=lambda k: (distance(fams[last], fams[k]), k))
        todo.remove(last)
        order.append(last)
    return order


def _fit_cheapest(problem, plans: list, fit, peak_of, limit, every: bool = False, among=None) -> list:
    """The plans over the limit solved again under it (``_fitted``), cheapest first, while
    one could still be the best that fits (or all of them, ``every``): a plan solved under
    the limit costs at least its time-optimal plan, so one whose time-optimal plan is no
    cheaper than a plan that fits is left as it is (on the GPT steps most families are
    over the limit, and each solve under it is several LPs)."""
    out = list(plans)
    order = sorted((i for i, p in enumerate(out) if p.choice is not None and not p.fits
                    and (among is None or i in among)), key=lambda i: out[i].time)
    for i in order:
        p = out[i]
        least = bound(out)
        if not every and least is not None and p.time >= least * (1 - 1e-12):
            p.note += "; not solved under the limit (a hand plan that fits is cheaper than its time-optimal plan)"
            continue
        out[i] = _fitted(problem, p, p.allowed, fit, peak_of, limit, p.key)
    return out


def _arguments_floor(problem, allowed: dict) -> float:
    """Bytes per device the step's arguments hold in the fewest-bytes layouts ``allowed``
    leaves them: alive the whole step, they are a floor under the plan's peak."""
    total = 0.0
    for v in problem.graph.inputs:
        if v in problem.values:
            t, vec = problem.values[v]
            total += float(vec[allowed[t]].min() if t in allowed else vec.min())
    return total


def _solve(problem, name, axes, allowed, peak_of, limit, time_limit, key=None, warm=None,
           exact: bool = True, lp=None, cutoff: Optional[float] = None) -> HandPlan:
    """The family narrowed to ``allowed``, solved for time and priced: its LP (``warm``,
    or ``lp`` where it was solved already), where that is integral, else the MILP; with
    ``exact=False`` a fractional LP is not gone on with: the plan has no time and ``lp``
    holds the LP's solution. ``cutoff`` (seconds): the warm LP is given up once its
    bound passes it, and the plan has no time (its note says so)."""
    plan = HandPlan(name, axes)
    t0 = time.perf_counter()
    reused = memo.HAND_SOLVES.get(key) if key is not None else None
    if reused is not None:   # (the solve is reused; the plan is priced again)
        choice, how = dict(reused), "its solve reused"
    else:
        sol = lp if lp is not None else \
            warm.solve(allowed, time_limit=time_limit, cutoff=cutoff) if warm is not None else None
        how = "warm LP"
        if getattr(sol, "above", None) is not None:
            plan.note = f"{time.perf_counter() - t0:.2f} s (warm LP): not solved to its optimum, its LP's bound " \
                        f"passed {sol.above * 1e3:.4f} ms, the best hand plan that fits as written over " \
                        f"{WRITTEN_SHARE}: no plan of it comes near that plan"
            return plan
        if not exact and sol is not None and sol.choice and sol.rounded:
            plan.lp, plan.note = sol, f"{time.perf_counter() - t0:.2f} s (warm LP, fractional)"
            return plan
        rounding = None
        if sol is None or not sol.choice or sol.rounded:   # (no model, or a fractional optimum: the MILP)
            how = ""
            if sol is not None and sol.choice:
                rounding = _lp_rounding(problem, sol)
            try:   # (within HAND_MILP_S: the best plan its branch and bound found by then)
                sol = milp.solve(milp.reduce(problem, memory_matters=False, allowed=allowed),
                                 time_limit=HAND_MILP_S if time_limit is None else min(time_limit, HAND_MILP_S),
                                 lp_first=None if sol is None else False)   # (the warm LP was fractional)
            except ShardingError as e:   # (the time limit before any plan)
                if rounding is None:
                    plan.note = str(e).splitlines()[0]
                    return plan
                sol = milp.Solution({}, float("inf"), float("inf"), float("inf"), str(e), 0.0, 0, 0)
        choice = {t: sol.choice.get(t, 0) for t in problem.unary} if sol.choice or not problem.unary else None
        # (a cut-short branch and bound may hold a plan dearer than the LP's rounding: on the
        # 2-layer GPT steps its plans after 10 s were 1.05-4.9x the roundings')
        if rounding is not None and (choice is None or problem.objective(rounding) < problem.objective(choice)):
            choice, how = rounding, "the LP's rounding, cheaper than the MILP's plan in its time"
        if choice is None:
            plan.note = sol.status
            return plan
    _price(problem, plan, choice, peak_of, limit)
    plan.note = f"{time.perf_counter() - t0:.2f} s" + (f" ({how})" if how else "")
    if key is not None and reused is None:
        _remember(key, choice)
    return plan


def _lp_rounding(problem, lp) -> Optional[dict]:
    """The whole plan of ``lp``'s rounding (each decision at its heaviest candidate), or
    None where it makes a move the model excludes (priced ``IMPOSSIBLE``)."""
    choice = {t: lp.choice.get(t, 0) for t in problem.unary}
    return choice if problem.objective(choice) < IMPOSSIBLE else None


def _of_family(problem, plan: HandPlan, choice: dict, peak_of, limit, allowed, key) -> HandPlan:
    """A new plan of ``plan``'s family (its narrowing ``allowed``, cache ``key``) as
    ``choice``, priced."""
    out = HandPlan(plan.name, plan.axes)
    out.allowed, out.key = allowed, key
    _price(problem, out, choice, peak_of, limit)
    return out


def _rounded(problem, plan: HandPlan, peak_of, limit, why: str) -> HandPlan:
    """``plan``'s family as its fractional LP's rounding, priced (not remembered: under
    another limit the family may need its exact solve), for the reason ``why`` (its LP
    bound is no less than the best hand plan that fits, so neither is its exact plan;
    or no plan fits, and the family's plan is a start for ``repair.py``). No plan where
    the rounding is impossible (a move the model excludes)."""
    choice = _lp_rounding(problem, plan.lp)
    if choice is None:
        plan.note += f"; not solved exactly: {why}, and its LP's rounding is impossible"
        plan.lp = None
        return plan
    out = _of_family(problem, plan, choice, peak_of, limit, plan.allowed, plan.key)
    out.note = f"{plan.note}; the LP's rounding, not solved exactly: {why}"
    return out


def _dived(problem, plan: HandPlan, dive, peak_of, limit) -> HandPlan:
    """``plan``'s family as the cheaper of its fractional LP's rounding and the plan
    ``dive`` finds from that LP, priced, its LP's bound in the note (not remembered, as
    ``_rounded``'s are not). No plan where neither is possible."""
    t0 = time.perf_counter()
    rounding = _lp_rounding(problem, plan.lp)
    dived = dive(plan.allowed, plan.lp, rounding)
    seconds = time.perf_counter() - t0
    if dived is not None and problem.objective(dived) >= IMPOSSIBLE:
        dived = None
    if dived is None and rounding is None:
        plan.note += f"; the dive from its fractional LP found no plan ({seconds:.2f} s), and its LP's rounding is " \
                     f"impossible"
        plan.lp = None
        return plan
    if dived is None or (rounding is not None and problem.objective(rounding) <= problem.objective(dived)):
        choice, how = rounding, "the LP's rounding, no dearer than what the dive from it found"
    else:
        choice, how = dived, "dived from its fractional LP"
    out = _of_family(problem, plan, choice, peak_of, limit, plan.allowed, plan.key)
    out.note = f"{plan.note}; {how} ({seconds:.2f} s; its LP's bound {plan.lp.bound * 1e3:.4f} ms)"
    return out


def _fitted(problem, plan: HandPlan, allowed: dict, fit, peak_of, limit, key) -> HandPlan:
    """``plan`` (over the limit) solved again under it by ``fit``, priced; ``plan``
    itself, its note saying so, where ``fit`` finds none that fits."""
    t0 = time.perf_counter()
    reused = memo.HAND_SOLVES.get(key)
    choice = dict(reused) if reused is not None else fit(allowed, plan.choice)
    seconds = time.perf_counter() - t0
    if choice is None:
        plan.note += f"; solved under the limit: none that fits found ({seconds:.2f} s)"
        return plan
    out = _of_family(problem, plan, choice, peak_of, limit, allowed, key)
    if not out.fits:   # (the rows fit; the modeled peak is the judge)
        plan.note += f"; solved under the limit: over it still ({seconds:.2f} s)"
        return plan
    out.note = f"{plan.note}; over the limit solved for time alone ({plan.peak / 2**20:.2f} MiB): solved under " \
               f"it, {seconds:.2f} s" + (" (its solve reused)" if reused is not None else "")
    if reused is None:
        _remember(key, choice)
    return out


def _price(problem, plan: HandPlan, choice: dict, peak_of, limit) -> None:
    """``plan`` as ``choice``: its modeled step (a copy once per reader, and as written),
    its peak and whether it fits."""
    plan_ops = problem.op_strategies(choice)
    e = problem.evaluate(*plan_ops)
    plan.time = e["compute"] + e["communication"]
    plan.written = problem.written(*plan_ops)
    plan.peak = peak_of(choice)
    plan.fits = limit is None or plan.peak <= limit
    plan.choice = choice


def _remember(key, choice: dict) -> None:
    memo.remember(memo.HAND_SOLVES, key, dict(choice), memo.HAND_SOLVES_MAX)


def best(plans: list) -> Optional[HandPlan]:
    """The hand plan that fits and is cheapest as written (the program that runs)."""
    fitting = [p for p in plans if p.fits and p.time is not None]
    return min(fitting, key=lambda p: (p.written, p.time)) if fitting else None


def bound(plans: list) -> Optional[float]:
    """The least objective (a copy once per reader) of the hand plans that fit: a plan
    the solve can match, so no candidate that cannot beat it need be searched."""
    fitting = [p.time for p in plans if p.fits and p.time is not None]
    return min(fitting) if fitting else None
