"""The redistribution planner: the cheapest sequence of collectives that turns a
tensor in one layout into the same global tensor in another.

Moves (each changes the layout by one step):
  all_reduce      partial over axes A           -> not partial over A
  reduce_scatter  partial over A                -> dim d additionally split by A (minor end)
  all_gather      dim d split by ..., A         -> dim d no longer split by A (a suffix)
  slice           axis A unused                 -> dim d additionally split by A (local, free)
  all_to_all      dim d1 split by ..., A        -> A moved to the minor end of dim d2
  permute         same local shape, blocks moved between ranks (axis replaced or swapped)

A Dijkstra search over layouts finds the cheapest path, so a plan never routes
through a replicated tensor when a cheaper path exists. Axes that travel
together in both layouts are bundled first, which keeps the search small on
meshes with many axes.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ..ir.layout import Layout
from ..ir.mesh import Mesh

from .cost import DEFAULT_COST, CostModel, wire_bytes

MAX_EXPANSIONS = 20000
MAX_KEPT_STATES = 4096   # per tensor and mesh, the states whose moves are kept


@dataclass(frozen=True)
class Step:
    kind: str
    params: tuple  # sorted (name, value) pairs
    before: Layout
    after: Layout
    wire_bytes: float
    group_size: int

    def param(self, name, default=None):
        return dict(self.params).get(name, default)


def _step(kind, before, after, nbytes, group, **params):
    return Step(kind, tuple(sorted(params.items())), before, after,
                wire_bytes(kind, nbytes, group), group)


def _set_dim(dims, d, axes):
    out = list(dims)
    out[d] = tuple(axes)
    return tuple(out)


def _moves(state: Layout, shape, itemsize, mesh: Mesh, allow_reduce_scatter: bool):
    local = state.local_shape(shape, mesh)
    nbytes = math.prod(local) * itemsize
    used = state.used_axes()
    free = [a for a in mesh.axis_names if a not in used]
    partial = state.partial
    size = mesh.axes_size
    rank = len(shape)
    # partial -> reduced
    for k in range(1, len(partial) + 1):
        for A in itertools.combinations(partial, k):
            rest = tuple(a for a in partial if a not in A)
            yield _step("all_reduce", state, Layout(state.dims, rest, state.partial_op), nbytes, size(A),
                        axes=A, op=state.partial_op)
    if allow_reduce_scatter and partial and state.partial_op == "sum":
        for k in range(1, len(partial) + 1):
            for A in itertools.permutations(partial, k):
                rest = tuple(a for a in partial if a not in A)
                for d in range(rank):
                    if local[d] % size(A) == 0:
                        yield _step("reduce_scatter", state,
                                    Layout(_set_dim(state.dims, d, state.dims[d] + A), rest, state.partial_op),
                                    nbytes, size(A), axes=A, dim=d)
    for d, axes in enumerate(state.dims):
        for k in range(1, len(axes) + 1):
            A = axes[-k:]
            keep = axes[:-k]
            yield _step("all_gather", state, Layout(_set_dim(state.dims, d, keep), partial, state.partial_op),
                        nbytes, size(A), axes=A, dim=d)
            for d2 in range(rank):
                if d2 != d and local[d2] % size(A) == 0:
                    dims = _set_dim(_set_dim(state.dims, d, keep), d2, state.dims[d2] + A)
                    yield _step("all_to_all", state, Layout(dims, partial, state.partial_op), nbytes, size(A),
                                axes=A, src_dim=d, dst_dim=d2)
    for a in free:
        for d in range(rank):
            if local[d] % mesh.axis_size(a) == 0:
                yield _step("slice", state, Layout(_set_dim(state.dims, d, state.dims[d] + (a,)), partial,
                                                   state.partial_op), nbytes, mesh.axis_size(a), axes=(a,), dim=d)
    # permutes: same local shape, blocks trade places between ranks
    placed = [(d, i, a) for d, axes in enumerate(state.dims) for i, a in enumerate(axes)]
    for d, i, a in placed:
        for b in free:
            if mesh.axis_size(b) == mesh.axis_size(a):
                dims = _set_dim(state.dims, d, state.dims[d][:i] + (b,) + state.dims[d][i + 1:])
                yield _step("permute", state, Layout(dims, partial, state.partial_op), nbytes,
                            mesh.axis_size(a), axes=(a, b))
    for (d1, i1, a1), (d2, i2, a2) in itertools.combinations(placed, 2):
        if mesh.axis_size(a1) == mesh.axis_size(a2):
            dims = [list(x) for x in state.dims]
            dims[d1][i1], dims[d2][i2] = a2, a1
            yield _step("permute", state, Layout(tuple(map(tuple, dims)), partial, state.partial_op), nbytes,
                        mesh.axis_size(a1), axes=(a1, a2))


class _States:
    """The layouts of one tensor on one mesh as numbered states, and the moves out
    of each with their times, worked out once: searches between different layouts
    of a tensor pass through the same states again and again."""

    def __init__(self, shape, itemsize, mesh: Mesh, allow_reduce_scatter: bool, cost: CostModel, real=None):
        self.args = (shape, itemsize, mesh, allow_reduce_scatter)
        self.cost = cost
        # (real mesh, {bundle: its real axes}): a profile prices a move by the devices it
        # runs over, so bundled axes are priced as the real axes they stand for
        self.real = (real[0], dict(real[1])) if real else None
        self.ids: dict[Layout, int] = {}
        self.layouts: list[Layout] = []
        self.edges: dict[int, tuple] = {}

    def id(self, layout: Layout) -> int:
        i = self.ids.get(layout)
        if i is None:
            i = self.ids[layout] = len(self.layouts)
            self.layouts.append(layout)
        return i

    def moves(self, i: int) -> tuple:
        """(step, state after, time, partial axes after) for every move out of state ``i``."""
        out = self.edges.get(i)
        if out is None:
            if len(self.edges) > MAX_KEPT_STATES:
                self.edges.clear()   # bounded memory: a search over many axes meets very many states
            out = self.edges[i] = tuple(
                (s, self.id(s.after), self._time(s), frozenset(s.after.partial))
                for s in _moves(self.layouts[i], *self.args))
        return out

    def _time(self, s: Step) -> float:
        if s.kind == "slice":
            return 0.0
        if self.real is None:
            return self.cost.collective_time(s.wire_bytes)
        mesh, members = self.real
        axes = tuple(a for v in s.param("axes") for a in members[v])
        return self.cost.collective_time(s.wire_bytes, s.kind, axes, mesh)


@lru_cache(maxsize=256)
def _states(shape, itemsize, mesh: Mesh, allow_reduce_scatter: bool, cost: CostModel, real=None) -> _States:
    return _States(shape, itemsize, mesh, allow_reduce_scatter, cost, real)


def _search(shape, itemsize, src: Layout, dst: Layout, mesh: Mesh, allow_reduce_scatter: bool,
            cost: CostModel, real=None) -> Optional[list[Step]]:
    states = _states(shape, itemsize, mesh, allow_reduce_scatter, cost, real)
    start, goal = states.id(src), states.id(dst)
    keep = frozenset(dst.partial)   # a partial the target keeps must never be reduced
    tie = itertools.count()
    frontier = [(0.0, 0, next(tie), start)]
    best = {start: 0.0}
    back: dict[int, tuple] = {}   # state -> (step into it, state before)
    expanded = 0
    while frontier:
        c, n, _, state = heapq.heappop(frontier)
        if state == goal:
            path = []
            while state != start:
                step, state = back[state]
                path.append(step)
            return path[::-1]
        if c > best.get(state, math.inf):
            continue
        expanded += 1
        if expanded > MAX_EXPANSIONS:
            return None
        for s, after, t, partial in states.moves(state):
            if keep and not keep <= partial:
                continue
            nc = c + t
            if nc < best.get(after, math.inf) - 1e-15:
                best[after] = nc
                back[after] = (s, state)
                heapq.heappush(frontier, (nc, n + 1, next(tie), after))
    return None


def _bundles(src: Layout, dst: Layout, mesh: Mesh) -> list[tuple[str, ...]]:
    """Groups of axes that sit next to each other, in the same order, in both layouts."""
    def positions(layout):
        pos = {}
        for d, axes in enumerate(layout.dims):
            for i, a in enumerate(axes):
                pos[a] = ("dim", d, i)
        for a in layout.partial:
            pos[a] = ("partial",)
        return pos

    ps, pt = positions(src), positions(dst)
    involved = [a for a in mesh.axis_names if a in ps or a in pt]

    def follows(pos, x, y):
        px, py = pos.get(x, ("free",)), pos.get(y, ("free",))
        if px[0] == "dim" and py[0] == "dim":
            return px[1] == py[1] and py[2] == px[2] + 1
        return px[0] == py[0] and px[0] in ("partial", "free")

    def order_key(a):
        t = pt.get(a, ("free",))
        s = ps.get(a, ("free",))
        return ({"dim": 0, "partial": 1, "free": 2}[t[0]], t[1:], {"dim": 0, "partial": 1, "free": 2}[s[0]],
                s[1:], mesh.axis_index(a))

    chains: list[list[str]] = []
    for a in sorted(involved, key=order_key):
        if chains and follows(ps, chains[-1][-1], a) and follows(pt, chains[-1][-1], a):
            chains[-1].append(a)
        else:
            chains.append([a])
    return [tuple(c) for c in chains]


def _to_virtual(layout: Layout, name_of: dict[str, str], vmesh: Mesh) -> Layout:
    def squash(axes):
        out = []
        for a in axes:
            v = name_of[a]
            if not out or out[-1] != v:
                out.append(v)
        return tuple(out)
    return Layout(tuple(squash(d) for d in layout.dims), vmesh.sort_axes(squash(layout.partial)), layout.partial_op)


def _from_virtual(layout: Layout, members: dict[str, tuple[str, ...]], mesh: Mesh) -> Layout:
    def expand(axes):
        return tuple(a for v in axes for a in members[v])
    return Layout(tuple(expand(d) for d in layout.dims), mesh.sort_axes(expand(layout.partial)), layout.partial_op)


def _real_axes(s: Step, members, mesh: Mesh) -> Optional[tuple]:
    """The real mesh axes a step on the virtual mesh runs over (None: it names none)."""
    axes = s.param("axes")
    if axes is None:
        return None
    axes = tuple(a for v in axes for a in members[v])
    return mesh.sort_axes(axes) if s.kind == "all_reduce" else axes


def _expand_step(s: Step, members, mesh: Mesh) -> Step:
    params = dict(s.params)
    if "axes" in params:
        params["axes"] = _real_axes(s, members, mesh)
    return Step(s.kind, tuple(sorted(params.items())), _from_virtual(s.before, members, mesh),
                _from_virtual(s.after, members, mesh), s.wire_bytes, s.group_size)


def _fallback(shape, itemsize, src: Layout, dst: Layout, mesh: Mesh) -> list[Step]:
    """Always valid: reduce every partial, gather every dim, then slice to the target."""
    steps, cur = [], src
    nbytes = lambda l: math.prod(l.local_shape(shape, mesh)) * itemsize  # noqa: E731
    drop = tuple(a for a in cur.partial if a not in dst.partial)
    if drop:
        nxt = Layout(cur.dims, tuple(a for a in cur.partial if a in dst.partial), cur.partial_op)
        steps.append(_step("all_reduce", cur, nxt, nbytes(cur), mesh.axes_size(drop), axes=drop, op=cur.partial_op))
        cur = nxt
    for d, axes in enumerate(cur.dims):
        if axes:
            nxt = Layout(_set_dim(cur.dims, d, ()), cur.partial, cur.partial_op)
            steps.append(_step("all_gather", cur, nxt, nbytes(cur), mesh.axes_size(axes), axes=axes, dim=d))
            cur = nxt
    for d, axes in enumerate(dst.dims):
        for a in axes:
            nxt = Layout(_set_dim(cur.dims, d, cur.dims[d] + (a,)), cur.partial, cur.partial_op)
            steps.append(_step("slice", cur, nxt, nbytes(cur), mesh.axis_size(a), axes=(a,), dim=d))
            cur = nxt
    return steps


def _merge_slices(steps: list[Step]) -> list[Step]:
    """Consecutive slices become one local slice with several cuts."""
    out: list[Step] = []
    for s in steps:
        if s.kind == "slice" and out and out[-1].kind == "slice":
            prev = out.pop()
            cuts = prev.param("cuts") + ((s.param("dim"), s.param("axes")),)
            out.append(Step("slice", (("cuts", cuts),), prev.before, s.after, 0.0,
                            prev.group_size * s.group_size))
        elif s.kind == "slice":
            out.append(Step("slice", (("cuts", ((s.param("dim"), s.param("axes")),)),), s.before, s.after, 0.0,
                            s.group_size))
        else:
            out.append(s)
    # a slice's cuts on the same dim in sequence merge into one cut
    merged = []
    for s in out:
        if s.kind == "slice":
            cuts: dict[int, tuple] = {}
            for d, axes in s.param("cuts"):
                cuts[d] = cuts.get(d, ()) + tuple(axes)
            s = Step("slice", (("cuts", tuple(sorted(cuts.items()))),), s.before, s.after, 0.0, s.group_size)
        merged.append(s)
    return merged


@lru_cache(maxsize=65536)
def plan_redistribution(shape: tuple, itemsize: int, src: Layout, dst: Layout, mesh: Mesh,
                        allow_reduce_scatter: bool = True, cost: CostModel = DEFAULT_COST) -> tuple[Step, ...]:
    """The cheapest steps from ``src`` to ``dst`` for a tensor of global ``shape``."""
    if src == dst:
        return ()
    members, vsrc, vdst, vmesh = virtual_problem(src, dst, mesh)
    real = (mesh, tuple(members.items())) if cost.links else None   # only a profile prices groups apart
    # (the path is the cheapest back to back: one move waits for its group once, whatever
    # its steps, ``CostModel.move_time``)
    path = _search(tuple(shape), itemsize, vsrc, vdst, vmesh, allow_reduce_scatter, cost.back_to_back, real)
    if path is None:
        steps = _fallback(tuple(shape), itemsize, src, dst, mesh)
    else:
        steps = [_expand_step(s, members, mesh) for s in path]
    return tuple(_merge_slices(steps))


def virtual_problem(src: Layout, dst: Layout, mesh: Mesh) -> tuple[dict, Layout, Layout, Mesh]:
    """The move on its virtual mesh (``_bundles``): ({bundle: its real axes}, source,
    target, virtual mesh); a ValueError where the move would create a partial."""
    if not set(dst.partial) <= set(src.partial) or (dst.partial and dst.partial_op != src.partial_op):
        raise ValueError(f"cannot create a partial value: {src} -> {dst}")
    chains = _bundles(src, dst, mesh)
    members = {f"v{i}": c for i, c in enumerate(chains)}
    name_of = {a: v for v, c in members.items() for a in c}
    vmesh = Mesh(tuple(members), tuple(mesh.axes_size(c) for c in members.values()))
    return members, _to_virtual(src, name_of, vmesh), _to_virtual(dst, name_of, vmesh), vmesh


def redistribution_cost(shape, itemsize, src: Layout, dst: Layout, mesh: Mesh, allow_reduce_scatter=True,
                        cost: CostModel = DEFAULT_COST) -> float:
    """Seconds of ``plan_redistribution``'s steps (``CostModel.move_time``), priced on
    the virtual path itself: a step's price reads its kind, its bytes and (under a
    profile) the real axes its bundles stand for, which expanding it to real axes and
    merging its slices (free) leave as they are. That expansion was a third of the
    search's problem build (10,040 moves of the 2-layer GPT step)."""
    if src == dst:
        return 0.0
    return _virtual_cost(tuple(shape), itemsize, src, dst, mesh, allow_reduce_scatter, cost)


@lru_cache(maxsize=65536)
def _virtual_cost(shape: tuple, itemsize: int, src: Layout, dst: Layout, mesh: Mesh, allow_reduce_scatter: bool,
                  cost: CostModel) -> float:
    return virtual_move_cost(shape, itemsize, src, dst, mesh, virtual_problem(src, dst, mesh), allow_reduce_scatter,
                             cost)


def virtual_move_cost(shape: tuple, itemsize: int, src: Layout, dst: Layout, mesh: Mesh, virtual: tuple,
                      allow_reduce_scatter: bool, cost: CostModel) -> float:
    """``redistribution_cost`` of the move whose ``virtual_problem`` is ``virtual``
    (not memoized: ``plan_core.pricing.Prices`` keeps these by what they read)."""
    members, vsrc, vdst, vmesh = virtual
    real = (mesh, tuple(members.items())) if cost.links else None
    path = _search(tuple(shape), itemsize, vsrc, vdst, vmesh, allow_reduce_scatter, cost.back_to_back, real)
    if path is None:   # (no path within the search's bound: the fallback's steps, on the real mesh)
        return cost.move_time(plan_redistribution(tuple(shape), itemsize, src, dst, mesh, allow_reduce_scatter, cost),
                              mesh)
    return cost.move_time(path, mesh, lambda step: _real_axes(step, members, mesh))


def clear_caches() -> None:
    """Forget every memoized move (a benchmark's cold start)."""
    plan_redistribution.cache_clear()
    _virtual_cost.cache_clear()


def permute_pairs(before: Layout, after: Layout, shape, mesh: Mesh) -> tuple[tuple[int, int], ...]:
    """(source rank, destination rank) pairs realising a permute between two layouts
    with equal local shapes: every rank receives the block it must hold from a rank
    that holds it, each rank sending at most once (a bipartite matching)."""
    # A rank may only take over blocks from a rank with the same coordinates on the
    # partial axes, so that each summand of a partial value is kept exactly once.
    def key(layout, r):
        return layout.block_index(r, mesh), tuple(mesh.coords(r)[a] for a in before.partial)

    holders: dict[tuple, list[int]] = {}
    for r in range(mesh.size):
        holders.setdefault(key(before, r), []).append(r)
    want = {r: key(after, r) for r in range(mesh.size)}
    match_src: dict[int, int] = {}  # source -> destination

    def augment(dst, seen):
        cands = sorted(holders.get(want[dst], []), key=lambda s: (s != dst, s))
        for s in cands:
            if s in seen:
                continue
            seen.add(s)
            if s not in match_src or augment(match_src[s], seen):
                match_src[s] = dst
                return True
        return False

    for r in range(mesh.size):
        if not augment(r, set()):
            raise ValueError(f"no permutation takes {before} to {after}")
    return tuple(sorted((s, d) for s, d in match_src.items()))
