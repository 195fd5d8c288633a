"""What every choice costs: the search problem over a graph (the *what*, no solver).

Decisions ("nodes"): every function argument (its layout) and every op that needs
a decision of its own (a matmul, a convolution, a user's mark, a loop). Every
other op *follows* its main operand (the largest one): its strategy is read off
the layout that operand arrives in, so a chain of elementwise ops, reductions and
reshapes is one node with its producer. A node's candidates come from its root's
factor rule (``candidates.py``); a follower's strategy per candidate is derived.

Repeated layers share variables: ops that repeat back to back (a tandem repeat of
equal ops, ``runtime/repeats.py``) map to the first repetition, and a node whose
members all map to one template node takes that node's variables. Costs of every
real node and edge are summed onto the templates, so the shared problem prices
the whole program exactly, under the constraint that all layers agree.

Costs, in seconds of the cost model: each op's compute per device (split work
is divided, replicated work repeated), each operand's redistribution from the
layout its producer makes to the layout the consumer's strategy needs (the
redistribution planner's own costs), a partial output's completion, a returned
state's way back to its argument's layout, and per value its local bytes (for
the memory limit, see ``memory.py``).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...ir.graph import CONSTRAINT, Graph, Op, Value
from ...ir.layout import Layout
from ...ir.repeats import find_repeats

from ..cost import CostModel
from ..insert_reshards import gathered_per_use
from ..plan_core.context import PlanContext, RuleBook
from ..plan_core.evaluate import evaluate_plan
from ..plan_core.pricing import Prices
from ..rules import FIXED
from ..sharding import OpStrategy, factors_from_operands, project
from .candidates import factor_assignments, tensor_layouts

DECIDERS = ("dot_general", "conv_general_dilated")   # ops that always decide for themselves
SHARED_FROM = 7   # repetitions: see _repeat_map
SHARED_PERIOD = 20   # ops per repetition: see _repeat_map
EXPANDS = "expands"   # _main_operand: the op makes a bigger tensor than it reads (it follows a consumer)


@dataclass
class Edge:
    """The cost between two template nodes' candidates, by class: candidate i of node
    ``a`` makes the value in layout class ``rows[i]``, candidate j of ``b`` needs class
    ``cols[j]``; ``cost[rows[i], cols[j]]`` seconds (summed over every real edge it
    stands for). Classes keep the solver's pair variables few: a value has far
    fewer layouts than its producer has candidates."""
    a: int
    b: int
    rows: np.ndarray
    cols: np.ndarray
    cost: np.ndarray

    def dense(self) -> np.ndarray:
        return self.cost[np.ix_(self.rows, self.cols)]

    def at(self, i: int, j: int) -> float:
        return float(self.cost[self.rows[i], self.cols[j]])


@dataclass
class Node:
    root: object                      # an Op, or the index of a graph input
    members: list                     # ops that follow the root (the root op first)
    main: list                        # per member: index of the operand it follows (-1: the root op)
    template: int = -1                # the node whose variables this one shares
    candidates: list = field(default_factory=list)   # factor tuples (op root) or Layouts (input root)
    passthroughs: list = field(default_factory=list)  # (op root) per candidate: the partial it passes, or None
    strategies: list = field(default_factory=list)   # per candidate, per member: OpStrategy

    @property
    def is_input(self) -> bool:
        return isinstance(self.root, int)


class Problem:
    """The nodes, their candidates and every cost, summed onto template nodes:
    ``unary[t]`` (seconds per candidate), ``edges`` (``Edge``: seconds per pair of
    candidates, by layout class), ``values`` (per value: template node, local bytes per candidate)."""

    def __init__(self, graph: Graph, cost: CostModel, *, follow: bool = True, share_layers: bool = True,
                 allow_reduce_scatter: bool = True, prices: Optional[Prices] = None,
                 like: Optional["Problem"] = None):
        """``prices``: redistribution prices to share with other problems (other mesh
        arrangements of the same devices); ``like``: a problem over the same graph on
        another mesh, whose nodes and templates (which do not depend on the mesh) are reused."""
        self.graph, self.mesh, self.cost = graph, graph.mesh, cost
        self.follow, self.share = follow, share_layers
        self.allow_rs = allow_reduce_scatter
        self.prices = prices if prices is not None else Prices(cost, allow_reduce_scatter)
        self._strategy_cache: dict = {}
        self._class_cache: dict = {}
        self._class_ids: dict = {}
        self._matrix_cache: dict = {}
        # the graph as both planners read it (rules, users, resident values, step end)
        self.ctx = like.ctx if like is not None and like.graph is graph else PlanContext(graph, RuleBook(), cost.kernels)
        self.rules = self.ctx.rule
        self.compute_times = self.ctx.compute_times(cost, self.mesh)
        # values whose all_reduces XLA launches together at the step's end
        self.step_end = self.ctx.step_end
        if like is not None and like.graph is graph and (like.follow, like.share) == (follow, share_layers):
            self._reuse_nodes(like)
        else:
            self._build_nodes()
            self._map_templates()
        for n in self.nodes:
            if n.template == n.index:
                self._enumerate(n)
        for n in self.nodes:
            if n.template != n.index:
                t = self.nodes[n.template]
                n.candidates, n.strategies, n.passthroughs = t.candidates, t.strategies, t.passthroughs
        self._costs()

    # -- nodes ------------------------------------------------------------------
    def _build_nodes(self) -> None:
        g = self.graph
        self.nodes: list[Node] = []
        self.owner: dict[Value, tuple] = {}   # value -> (node, member position or -1, output index)
        self.node_of_op: dict[Op, tuple] = {}  # op -> (node, member position)
        for i, v in enumerate(g.inputs):
            self._new_node(i)
            self.owner[v] = (len(self.nodes) - 1, -1, 0)
        deferred = []   # ops that make a bigger tensor than they read: they follow a consumer
        self._users = self.ctx.users
        self.partial_sums: dict = {}   # op -> its linear group: a sum where partials may meet
        for op in g.ops:
            m = self._main_operand(op) if self.follow else self._own_decision(op)
            if m == EXPANDS:
                deferred.append(op)
                continue
            if m is None:
                node = self._new_node(op)
                node.main.append(-1)
            else:
                node = self.nodes[self.owner[op.inputs[m]][0]]
                node.members.append(op)
                node.main.append(m)
            self._place(op, node)
        users = self._users
        for op in reversed(deferred):   # a chain of them (broadcast of a broadcast) from its end
            consumer = next(((u, m) for v in op.outputs for u in users.get(v, ()) if u in self.node_of_op
                             for m, x in enumerate(u.inputs) if x is v), None)
            if consumer is None:
                node = self._new_node(op)
                node.main.append(-1)
            else:
                u, m = consumer
                node = self.nodes[self.node_of_op[u][0]]
                node.members.append(op)
                node.main.append(("consumer", self.node_of_op[u][1], m))
            self._place(op, node)

    def _reuse_nodes(self, like: "Problem") -> None:
        """The nodes, what follows what, and the templates of ``like`` (none depends on the mesh)."""
        self.owner, self.node_of_op, self._users = like.owner, like.node_of_op, like._users
        self.partial_sums = like.partial_sums
        self.nodes = []
        for n in like.nodes:
            node = Node(n.root, n.members, n.main, n.template)
            node.index = n.index
            self.nodes.append(node)

    def _place(self, op: Op, node: "Node") -> None:
        pos = len(node.members) - 1
        self.node_of_op[op] = (node.index, pos)
        for k, v in enumerate(op.outputs):
            self.owner[v] = (node.index, pos, k)

    def _new_node(self, root) -> Node:
        n = Node(root, [root] if isinstance(root, Op) else [], [])
        n.index = len(self.nodes)
        self.nodes.append(n)
        return n

    def _main_operand(self, op: Op) -> Optional[int]:
        """The operand an op follows, or None if it decides for itself."""
        if op.kind in DECIDERS or op.subgraphs or op.kind in FIXED or op.region is not None:
            return None
        if op.kind == CONSTRAINT and op.pinned is not None:
            return None
        # a value two matmuls read (an activation: the next layer's and the weight
        # gradient's) decides its own layout: following, it would be redistributed once
        # per reader where one redistribution before this op serves both
        if any(sum(u.kind in DECIDERS for u in self._users.get(v, ())) >= 2 for v in op.outputs):
            return None
        rule = self.rules(op)
        if self._note_partial_sum(op, rule):
            return None
        best = None
        for m, v in enumerate(op.inputs):
            if v.literal is not None or rule.operands[m] is None or v not in self.owner:
                continue
            # the most bytes: a select follows the values it picks from, not its boolean mask
            if best is None or _nbytes(v) > _nbytes(op.inputs[best]):
                best = m
        # an argument and a value an op made, of one size (a residual x + f(x), an update
        # p - lr * g): following the argument would tie its layout to this op's, though it is
        # sliced for free to whatever the op takes; the op decides for itself
        if best is not None and self.owner[op.inputs[best]][1] == -1 and any(
                v.literal is None and rule.operands[m] is not None and v in self.owner and self.owner[v][1] != -1
                and _numel(v) == _numel(op.inputs[best]) for m, v in enumerate(op.inputs)):
            return None
        # where values of one size that two matmuls made meet (ReLU's backward select of
        # the cotangent by the forward activation's mask), following either would tie
        # the other's matmul to this op's layout; the op decides where they meet
        if self._joins_two_matmuls(op, rule):
            return None
        # an op that makes a bigger tensor than it reads (a broadcast, a concatenate, a
        # pad) takes the layout its consumer wants (slicing it is free): following its
        # operand would leave its new dims whole
        biggest_out = max((_numel(v) for v in op.outputs), default=0)
        if best is None or _numel(op.inputs[best]) < biggest_out:
            return EXPANDS if len(op.outputs) == 1 else None
        # a value that may arrive partial (a weight gradient), passed on to two or more
        # readers (Adam's two moments read the transposed gradient): following, this op
        # would carry the partial to each reader, completed once per reader; deciding, it
        # completes it once, into the layout that suits them all
        if self._may_be_partial(op.inputs[best]) and sum(len(self._users.get(v, ())) for v in op.outputs) >= 2:
            return None
        return best

    def _joins_two_matmuls(self, op: Op, rule) -> bool:
        size = max((_numel(v) for v in op.outputs), default=0)
        roots = {self.owner[v][0] for m, v in enumerate(op.inputs)
                 if v.literal is None and rule.operands[m] is not None and v in self.owner and _numel(v) == size
                 and self._made_by_matmul(v)}
        return len(roots) >= 2

    def _made_by_matmul(self, v: Value) -> bool:
        """Whether ``v``'s node's root is a matmul/conv."""
        root = self.nodes[self.owner[v][0]].root
        return isinstance(root, Op) and root.kind in DECIDERS

    def _may_be_partial(self, v: Value) -> bool:
        """Whether ``v``'s node's root is a matmul/conv or a sum of partials."""
        return self._made_by_matmul(v) or self.nodes[self.owner[v][0]].root in self.partial_sums

    def _own_decision(self, op: Op) -> None:
        """(Without followers: every op decides; a sum of partials still gets its
        passthrough candidates.)"""
        if op.kind in DECIDERS or op.subgraphs or op.kind in FIXED or op.region is not None or op.kind == CONSTRAINT:
            return None
        self._note_partial_sum(op, self.rules(op))
        return None

    def _note_partial_sum(self, op: Op, rule) -> bool:
        """Record ``op`` in ``partial_sums`` if it is one (``_partial_sum_group``)."""
        group = self._partial_sum_group(op, rule)
        if group is not None:
            self.partial_sums[op] = group
        return group is not None

    def _partial_sum_group(self, op: Op, rule) -> Optional[int]:
        """The linear group of a sum where two values that may arrive partial meet
        (an activation's gradient summed over the projections that read it): it decides
        whether to add them partial and complete the sum once, or complete each first.
        Following one of them it could only do the latter. A value may arrive partial
        when its node's root is a matmul/conv or such a sum."""
        for gi, (group, pop) in enumerate(rule.linear):
            if pop != "sum" or len(group) < 2:
                continue
            maybe_partial = 0
            for m in group:
                v = op.inputs[m]
                if v.literal is not None or v not in self.owner:
                    continue
                maybe_partial += self._may_be_partial(v)
            if maybe_partial >= 2:
                return gi
        return None

    # -- repeated layers --------------------------------------------------------
    def _map_templates(self) -> None:
        """Each node's template: the first node that is the same decision in an earlier
        repetition (its root and members repeat the same ops, following the same
        operands; an argument: same type, pin and readers)."""
        g = self.graph
        op_tmpl = _repeat_map([self.ctx.layer_token(op) for op in g.ops]) if self.share else {}
        index = {op: k for k, op in enumerate(g.ops)}

        def canon(op):
            k = index[op]
            return op_tmpl.get(k, k)
        readers: dict = {}
        if self.share:
            for op in g.ops:
                for v in op.inputs:
                    if v in self.owner and self.owner[v][1] == -1:
                        readers.setdefault(v, []).append(canon(op))
        first: dict = {}
        for n in self.nodes:
            n.template = n.index
            if not self.share:
                continue
            shape = tuple((canon(op), m, self._main_place(op, m)) for op, m in zip(n.members, n.main))
            if n.is_input:
                v = g.inputs[n.root]
                key = ("input", v.type, g.pinned_inputs.get(n.root), tuple(readers.get(v, ())), shape)
            else:
                key = ("op", shape)
            n.template = first.setdefault(key, n.index)

    def _main_place(self, op: Op, m) -> tuple:
        """Where in its node the operand an op follows is made (member, output)."""
        if type(m) is not int or m < 0:
            return ()
        return self.owner[op.inputs[m]][1:]

    # -- candidates -------------------------------------------------------------
    def _enumerate(self, n: Node) -> None:
        g, mesh = self.graph, self.mesh
        if n.is_input:
            v = g.inputs[n.root]
            pinned = g.pinned_inputs.get(n.root)
            n.candidates = [pinned] if pinned is not None else tensor_layouts(v.type.shape, mesh)
            layouts = n.candidates
        else:
            op = n.root
            rule = self.rules(op)
            n.candidates = factor_assignments(rule, mesh, self._fixed(op, rule))
            if not n.candidates:   # a fixed part that no assignment completes: keep it as it is
                fixed = self._fixed(op, rule)
                n.candidates = [tuple(a or () for a in fixed)]
            n.passthroughs = [None] * len(n.candidates)
            if op in self.partial_sums:
                self._add_partial_candidates(n, rule, self.partial_sums[op])
            layouts = None
        for k, cand in enumerate(n.candidates):
            row = []
            produced: dict = {}
            for pos, (op, m) in enumerate(zip(n.members, n.main)):
                if m == -1:
                    pt = n.passthroughs[k] if n.passthroughs else None
                    st = self.ctx.book.strategy(self.rules(op), tuple(cand), pt)
                elif type(m) is tuple:   # follows what its consumer (member m[1]) needs of it
                    u = n.members[m[1]]
                    need = row[m[1]].operand_layout(m[2], u.inputs[m[2]].type.rank, mesh)
                    st = self._follow_consumer(op, need)
                else:
                    v = op.inputs[m]
                    _, p, out = self.owner[v]
                    src = layouts[k] if p == -1 else produced[(p, out)]
                    st = self._follow(op, m, src)
                row.append(st)
                for o in range(len(op.outputs)):
                    produced[(pos, o)] = st.result_layout(o, mesh)
            n.strategies.append(row)

    def _add_partial_candidates(self, n: Node, rule, group: int) -> None:
        """A partial sum's candidates again with the partial passed through, over every
        set of the mesh axes its factors leave free (its operands in that group then
        arrive partial over them, and its result is partial)."""
        mesh = self.mesh
        for cand in list(n.candidates):
            used = {a for axes in cand for a in axes}
            free = [a for a in mesh.axis_names if a not in used]
            for r in range(1, len(free) + 1):
                for axes in itertools.combinations(free, r):
                    if not OpStrategy(rule, tuple(cand), (group, axes)).problems(mesh):
                        n.candidates.append(cand)
                        n.passthroughs.append((group, axes))

    def _fixed(self, op: Op, rule) -> list:
        mesh = self.mesh
        if op.kind in FIXED:
            return list(FIXED[op.kind](op, mesh))
        if op.kind == CONSTRAINT and op.pinned is not None:
            return factors_from_operands(rule, op, [op.pinned], mesh)[0]
        if op.region is not None:
            producers = self._producers()
            layouts = [producers[v].pinned if v in producers and producers[v].kind == CONSTRAINT else None
                       for v in op.inputs]
            return factors_from_operands(rule, op, layouts, mesh)[0]
        return [None] * rule.num_factors

    def _producers(self) -> dict:
        if not hasattr(self, "_producer_map"):
            self._producer_map = self.graph.producers()
        return self._producer_map

    def _follow(self, op: Op, m: int, src: Layout) -> OpStrategy:
        """The strategy of an op that follows operand ``m`` arriving in ``src``: the
        splits it can keep, a partial passed through where the op is linear in that
        operand alone; what it cannot keep is made whole."""
        rule, mesh = self.rules(op), self.mesh
        key = ("follow", id(rule), m, src)
        st = self._strategy_cache.get(key)
        if st is not None:
            return st
        proposal = project(rule.operands[m], src.dims, rule, mesh)
        factors = tuple(proposal.get(f, ()) if rule.shardable(f) else () for f in range(rule.num_factors))
        passthrough = None
        if src.partial:
            for gi, (group, pop) in enumerate(rule.linear):
                if group == (m,) and pop == src.partial_op:
                    passthrough = (gi, tuple(src.partial))
                    break
        for attempt in ((factors, passthrough), (factors, None), (((),) * rule.num_factors, None)):
            st = OpStrategy(rule, *attempt)
            if not st.problems(mesh):
                break
        st = self.ctx.book.strategy(rule, st.factors, st.passthrough)
        self._strategy_cache[key] = st
        return st

    def _follow_consumer(self, op: Op, need: Layout) -> OpStrategy:
        """The strategy of an op that makes its result in the layout its consumer needs
        (what its rule can make of it; the rest whole)."""
        rule, mesh = self.rules(op), self.mesh
        key = ("consumer", id(rule), need)
        st = self._strategy_cache.get(key)
        if st is not None:
            return st
        proposal = project(rule.results[0], need.dims, rule, mesh)
        factors = tuple(proposal.get(f, ()) if rule.shardable(f) and f not in rule.reduction else ()
                        for f in range(rule.num_factors))
        st = OpStrategy(rule, factors)
        if st.problems(mesh):
            st = OpStrategy(rule, ((),) * rule.num_factors)
        st = self._strategy_cache[key] = self.ctx.book.strategy(rule, st.factors, None)
        return st

    # -- costs --------------------------------------------------------------------
    def layout_of(self, v: Value, node: Node, k: int) -> Layout:
        _, p, out = self.owner[v]
        if p == -1:
            return node.candidates[k]
        return node.strategies[k][p].result_layout(out, self.mesh)

    def _costs(self) -> None:
        g, mesh = self.graph, self.mesh
        T = [n.template for n in self.nodes]
        self.unary = {t: np.zeros(len(self.nodes[t].candidates)) for t in set(T)}
        self.compute = {t: np.zeros(len(self.nodes[t].candidates)) for t in set(T)}
        self._terms: dict = {}   # real edge key -> [(tp, tc), matrix by class, count]
        cache: dict = {}
        compute_cache: dict = {}
        # a value one decision reads more than once (two of its ops, or one op twice) is
        # moved once per layout that decision's candidate needs it in: its reads are one term
        reads: dict = {}
        for op in g.ops:
            ci, pc = self.node_of_op[op]
            for m, v in enumerate(op.inputs):
                if v.literal is None and v in self.owner:
                    reads.setdefault((v, T[ci]), []).append((ci, pc, m))
        for op in g.ops:
            ci, pc = self.node_of_op[op]
            cnode = self.nodes[ci]
            tc = T[ci]
            key = (tc, pc)
            comp = compute_cache.get(key)
            if comp is None:
                comp = compute_cache[key] = np.array([self.op_compute(op, row[pc]) for row in cnode.strategies])
            self.unary[tc] += comp
            self.compute[tc] += comp
            for m, v in enumerate(op.inputs):
                if v.literal is not None or v not in self.owner:
                    continue
                pi, pp, out = self.owner[v]
                tp = T[pi]
                together = reads[(v, tc)]
                if len(together) > 1:
                    if together[0] == (ci, pc, m):
                        self._add_reads(v, tc, together)
                    continue
                key = (tp, pp, out, tc, pc, m, pi == ci)
                mat = cache.get(key)
                if mat is None:
                    mat = cache[key] = self._matrix(v, self._classes_made(v, self.nodes[pi]),
                                                    self._classes_needed(v, cnode, pc, m), same=pi == ci)
                self._add(key, tp, tc, mat, pi == ci)
        for i, v in enumerate(g.outputs):
            if v.literal is not None or v not in self.owner:
                continue
            pi, pp, out = self.owner[v]
            pnode = self.nodes[pi]
            if i not in g.pinned_outputs and i in g.tied_outputs:   # an edge to its argument's node
                j = g.tied_outputs[i]
                ji = self.owner[g.inputs[j]][0]
                jnode = self.nodes[ji]
                mat = self._matrix(v, self._classes_made(v, pnode), self._classes_made(g.inputs[j], jnode),
                                   same=pi == ji)
                self._add(("tied", T[pi], pp, out, T[ji]), T[pi], T[ji], mat, pi == ji)
                continue
            vec = np.array([self.prices.output(g, i, self.layout_of(v, pnode, k), None, mesh, self.step_end)[1]
                            for k in range(len(pnode.candidates))])   # (pinned, or completed)
            self.unary[T[pi]] += vec
        self._memory_terms()
        self._edges()

    def _add_reads(self, v: Value, tc: int, together: list) -> None:
        """The reads of ``v`` by one decision (template ``tc``): per candidate of its maker and
        of the decision, each layout the reads need moved once (as insert-reshards writes
        it; a stored value gathered bigger once per read, as it writes that too)."""
        pi, pp, out = self.owner[v]
        tp = self.nodes[pi].template
        made = self._classes_made(v, self.nodes[pi])
        needed = [self._classes_needed(v, self.nodes[ci], pc, m) for ci, pc, m in together]
        joint, idx = np.unique(np.stack([n.index for n in needed], axis=1), axis=0, return_inverse=True)
        idx = idx.reshape(-1)
        key = ("reads", v.type, v in self.step_end.terminal, v in self.ctx.stored, made.ident,
               tuple(n.ident for n in needed), joint.tobytes())
        small = self._matrix_cache.get(key)
        if small is None:
            small = self._matrix_cache[key] = self._reads_matrix(v, made, needed, joint)
        term = ("reads", tp, pp, out, tc, tuple((pc, m) for _, pc, m in together))
        if tp == tc:   # (the maker's own decision, or a repetition of it: one candidate for both)
            self.unary[tc] += small[made.index, idx]
        else:
            self._add(term, tp, tc, (small, made.index, idx), False)

    def _reads_matrix(self, v: Value, made: "_Classes", needed: list, joint: np.ndarray) -> np.ndarray:
        """Seconds per (layout class made, joint class of the reads' needs)."""
        out = np.zeros((len(made.layouts), len(joint)))
        for s, have in enumerate(made.layouts):
            for u, classes in enumerate(joint):
                moved = set()
                for n, c in zip(needed, classes):
                    need = n.layouts[c]
                    if need in moved and not gathered_per_use(v, have, need, self.ctx.stored, self.mesh):
                        continue
                    moved.add(need)
                    out[s, u] += self.redistribution(v, have, need)
        return out

    def _add(self, key, tp: int, tc: int, mat, same_node: bool) -> None:
        if same_node:
            self.unary[tc] += mat          # (a vector: source and target share the candidate)
            return
        small, rows, cols = mat
        if tp == tc:
            self.unary[tc] += small[rows, cols]
            return
        term = self._terms.get(key)
        if term is None:
            self._terms[key] = [tp, tc, mat, 1]
        else:
            term[3] += 1

    def _edges(self) -> None:
        """The real edges' terms, those with the same two nodes and classes summed."""
        merged: dict = {}
        for tp, tc, (small, rows, cols), count in self._terms.values():
            if tp > tc:
                tp, tc, small, rows, cols = tc, tp, small.T, cols, rows
            key = (tp, tc, rows.tobytes(), cols.tobytes())
            if key in merged:
                merged[key].cost = merged[key].cost + small * count
            else:
                merged[key] = Edge(tp, tc, rows, cols, small * count)
        by_pair: dict = {}
        for e in merged.values():
            by_pair.setdefault((e.a, e.b), []).append(e)
        self.edges = [es[0] if len(es) == 1 else _joined(es) for es in by_pair.values()]

    def _classes_made(self, v: Value, node: Node) -> "_Classes":
        """The layouts ``v`` is made in by ``node``'s candidates, as classes (shared by
        every repetition of the node)."""
        _, p, out = self.owner[v]
        key = ("made", node.template, p, out)
        c = self._class_cache.get(key)
        if c is None:
            c = self._class_cache[key] = self._intern([self.layout_of(v, node, k) for k in range(len(node.candidates))])
        return c

    def _classes_needed(self, v: Value, node: Node, pos: int, m: int) -> "_Classes":
        """The layouts member ``pos`` of ``node`` needs its operand ``m`` (``v``) in, per candidate."""
        key = ("needed", node.template, pos, m)
        c = self._class_cache.get(key)
        if c is None:
            rank, mesh = v.type.rank, self.mesh
            c = self._class_cache[key] = self._intern([row[pos].operand_layout(m, rank, mesh)
                                                       for row in node.strategies])
        return c

    def _intern(self, layouts: list) -> "_Classes":
        uniq, idx = _unique(layouts)
        key = tuple(uniq)
        ident = self._class_ids.setdefault(key, len(self._class_ids))   # equal sets compare by number
        return _Classes(uniq, idx, ident)

    def _matrix(self, v: Value, src: "_Classes", dst: "_Classes", same: bool):
        """Seconds to take ``v`` from the layout ``src`` gives candidate i of its producer
        to the layout ``dst`` gives candidate j of its consumer: (matrix by class, class of
        each i, class of each j); a vector over the candidates when they are one node.
        Matrices are priced once per value type and pair of layout sets: repeated
        layers, and every op reading a value of the same type in the same layouts,
        share one."""
        if same:
            key = ("same", v.type, v in self.step_end.terminal, src.ident, dst.ident, src.index.tobytes(),
                   dst.index.tobytes())
            vec = self._matrix_cache.get(key)
            if vec is None:
                vec = self._matrix_cache[key] = np.array([
                    self.redistribution(v, src.layouts[a], dst.layouts[b]) for a, b in zip(src.index, dst.index)])
            return vec
        key = (v.type, v in self.step_end.terminal, src.ident, dst.ident)
        small = self._matrix_cache.get(key)
        if small is None:
            small = self._matrix_cache[key] = np.array([[self.redistribution(v, a, b) for b in dst.layouts]
                                                        for a in src.layouts])
        return small, src.index, dst.index

    def redistribution(self, v: Value, src: Layout, dst: Layout) -> float:
        """Seconds to move ``v`` (``plan_core.pricing``)."""
        return self.prices.move(v, src, dst, self.mesh, self.step_end)

    def op_compute(self, op: Op, st: OpStrategy) -> float:
        """The op's compute seconds per device (``cost.ComputeTimes``, as propagation prices it)."""
        return self.compute_times.time(op, st.rule.flops, st.factors)

    def _memory_terms(self) -> None:
        """Per value: (template node, local bytes per candidate)."""
        mesh = self.mesh
        self.values: dict = {}
        cache: dict = {}
        for v, (ni, p, out) in self.owner.items():
            t = self.nodes[ni].template
            key = (t, p, out)
            vec = cache.get(key)
            if vec is None:
                made = self._classes_made(v, self.nodes[ni])
                per_class = np.array([math.prod(lay.local_shape(v.type.shape, mesh)) * v.type.itemsize
                                      for lay in made.layouts], dtype=float)
                vec = cache[key] = per_class[made.index]
            self.values[v] = (t, vec)

    # -- a choice -----------------------------------------------------------------
    @property
    def templates(self) -> list[int]:
        return sorted(self.unary)

    @functools.cached_property
    def fingerprint(self) -> tuple:
        """What a solve of this problem depends on: the mesh, every decision's costs and
        bytes, every edge's costs (equal fingerprints: the same problem, numbered alike).
        Keys the hand plans' reused solves and the warm LP models (``passes/auto``)."""
        h = hashlib.sha1()
        for t in sorted(self.unary):
            h.update(np.int64(t).tobytes())
            h.update(np.ascontiguousarray(self.unary[t]).tobytes())
        for e in self.edges:
            h.update(np.array([e.a, e.b], dtype=np.int64).tobytes())
            h.update(np.ascontiguousarray(e.rows).tobytes() + np.ascontiguousarray(e.cols).tobytes())
            h.update(np.ascontiguousarray(e.cost).tobytes())
        for v, (t, vec) in self.values.items():
            h.update(np.int64(t).tobytes())
            h.update(np.ascontiguousarray(vec).tobytes())
        return str(self.mesh), h.hexdigest()

    @functools.cached_property
    def edges_at(self) -> dict:
        """Template node -> the edges touching it (the edges are final once built)."""
        at: dict = {}
        for e in self.edges:
            at.setdefault(e.a, []).append(e)
            at.setdefault(e.b, []).append(e)
        return at

    def switch_deltas(self, choice: dict, t: int) -> np.ndarray:
        """What the objective of ``choice`` gains with decision ``t`` at each of its
        candidates instead, every other decision kept: its own cost's difference and its
        edges' against the neighbours' choices (0 at ``choice[t]``; no edge joins a node to
        itself: ``_add`` folds those into ``unary``)."""
        k = choice[t]
        delta = self.unary[t] - self.unary[t][k]
        for e in self.edges_at.get(t, ()):
            vec = e.cost[:, e.cols[choice[e.b]]][e.rows] if e.a == t else e.cost[e.rows[choice[e.a]], :][e.cols]
            delta = delta + vec - vec[k]
        return delta

    def objective(self, choice: dict) -> float:
        """Modeled step time of a choice (template node -> candidate index)."""
        total = sum(self.unary[t][choice[t]] for t in self.unary)
        total += sum(e.at(choice[e.a], choice[e.b]) for e in self.edges)
        return float(total)

    @functools.cached_property
    def decisions(self) -> dict:
        """Op -> the decision (template node) it belongs to: the reads of a value by one
        decision share a copy per layout in the objective (``_add_reads``)."""
        return {op: self.nodes[ci].template for op, (ci, _) in self.node_of_op.items()}

    def evaluate(self, ops: dict, inputs: dict, breakdown: Optional[dict] = None) -> dict:
        """What a plan (op -> OpStrategy, input index -> Layout) costs, walked op by op
        (no candidates): ``plan_core.evaluate``, each copy priced as the objective prices
        it (once per layout per reading decision)."""
        return evaluate_plan(self.ctx, ops, inputs, self.prices, self.compute_times, decisions=self.decisions,
                             breakdown=breakdown)

    def written(self, ops: dict, inputs: dict) -> float:
        """Modeled seconds of a plan as ``insert-reshards`` writes it: a value needed in one
        layout by several ops is moved once (``evaluate``, the objective, moves it once per
        reader: an upper bound, linear in the decisions). The price propagation gives the
        same plan, so what the search's plan and a hand plan are compared by."""
        e = evaluate_plan(self.ctx, ops, inputs, self.prices, self.compute_times, shared_copies=True, detail=False)
        return e["compute"] + e["communication"]

    def op_strategies(self, choice: dict) -> tuple[dict, dict]:
        """(op -> OpStrategy, input index -> Layout) of a choice."""
        ops, inputs = {}, {}
        for n in self.nodes:
            k = choice[n.template]
            if n.is_input:
                inputs[n.root] = n.candidates[k]
            for op, st in zip(n.members, n.strategies[k]):
                ops[op] = st
        return ops, inputs


def _repeat_map(tokens: list) -> dict:
    """position -> the position it repeats. Inside a run of repetitions (and runs
    inside one repetition: the optimizer's update of each layer inside the update of
    each state), every repetition maps to the first, from ``SHARED_FROM`` repetitions
    on, or from two where a repetition has ``SHARED_PERIOD`` ops or more. A short run of
    small blocks (an MLP's layers, a few ops each) keeps a decision per repetition: its
    problem is small anyway, and the layers next to what comes before and after the
    stack (the input, the loss) want other strategies, which matters most when they are
    a large part of it (a 3-layer SGD MLP planned alike was 20% above the exact ILP). A
    block of many ops (a transformer layer: 40-113 ops per period in the GPT step) is
    planned alike, as an engineer plans every layer: per repetition it would multiply
    the search's LP (the 2-layer GPT step's hand plans' LPs took twice as long, to the
    same plans or dearer ones), and a deep stack shares one set (the problem's size then
    does not grow with depth at all)."""
    ids: dict = {}
    seq = [ids.setdefault(t, len(ids)) for t in tokens]
    out: dict = {}

    def walk(repeats, base, into):
        for r in repeats:
            start = base + r.start
            inner: dict = {}
            walk(r.inner, start, inner)
            for rep in range(r.count):
                # the repetition this one shares with: in a short run of small blocks, its own
                like = rep if r.count < SHARED_FROM and r.period < SHARED_PERIOD else 0
                for i in range(r.period):
                    first = start + i
                    own = start + rep * r.period + i
                    target = inner.get(first, first) + like * r.period
                    if target != own:
                        into[own] = target

    walk(find_repeats(seq), 0, out)
    return out


def _joined(edges: list) -> Edge:
    """Edges between the same two decisions as one (exact: the same cost for every pair
    of candidates), classed by the tuple of their classes. Apart, the LP relaxation
    may pair each edge's classes differently (two readers of one value, each priced at
    another candidate of its maker): a cycle of two, where one edge is a tree's."""
    a, b = edges[0].a, edges[0].b
    rows_u, rows = np.unique(np.stack([e.rows for e in edges], axis=1), axis=0, return_inverse=True)
    cols_u, cols = np.unique(np.stack([e.cols for e in edges], axis=1), axis=0, return_inverse=True)
    cost = np.zeros((len(rows_u), len(cols_u)))
    for i, e in enumerate(edges):
        cost += e.cost[np.ix_(rows_u[:, i], cols_u[:, i])]
    return Edge(a, b, rows.reshape(-1), cols.reshape(-1), cost)


def _numel(v: Value) -> int:
    return math.prod(v.type.shape)


def _nbytes(v: Value) -> int:
    return _numel(v) * v.type.itemsize


@dataclass
class _Classes:
    """A value's layout per candidate, as classes: ``layouts[index[k]]`` for candidate k;
    ``ident`` numbers the set of layouts (equal sets, equal numbers)."""
    layouts: list
    index: np.ndarray
    ident: int


def _unique(layouts: list) -> tuple[list, np.ndarray]:
    index: dict = {}
    idx = np.array([index.setdefault(l, len(index)) for l in layouts], dtype=int)
    return list(index), idx
