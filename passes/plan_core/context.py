"""One context per graph: what both planners read of a graph and never change.

Built once per graph (``PlanContext``), each part on first use: the ops' factor
rules (interned by ``RuleBook``: one object per equal rule, across graphs), the
producer and users maps, the values fusion keeps out of memory, the step's end
(``cost.StepEnd``), propagation's op signatures (its memo keys) and the search's
layer tokens (its repeated layers); and, per cost model and mesh, what a strategy
costs in compute (``cost.ComputeTimes``).
"""
from __future__ import annotations

import functools

from ...ir.graph import Graph, Op

from ..cost import ComputeTimes, CostModel, StepEnd
from ..fusion import resident_values
from ..insert_reshards import stored_values
from ..rules import rule_for
from ..sharding import OpStrategy


def op_key(op: Op):
    """What an op computes: (primitive, operand types, result types, params), the
    op itself where that does not hash (a body, a param jax gave as a list)."""
    if op.subgraphs:
        return op
    try:
        key = (op.kind, tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs),
               tuple(sorted(op.params.items())))
        hash(key)
    except TypeError:
        return op
    return key


class RuleBook:
    """Each op's factor rule, one object for all equal rules (so a memo key may name a
    rule by its id), one strategy object for all equal strategies (they memoize their
    layouts), and the small ints naming propagation's op signatures; shared by every
    graph one engine plans (a loop's body and its caller; the search's arrangements)."""

    def __init__(self):
        self._by_key: dict = {}        # op_key -> rule
        self._interned: dict = {}      # rule -> the one equal rule object
        self._strategies: dict = {}    # (rule id, factors, passthrough) -> the one OpStrategy
        self.signature_ids: dict = {}  # (rule id, operand flags, result flags) -> small int

    def strategy(self, rule, factors: tuple, passthrough=None) -> OpStrategy:
        """The one ``OpStrategy`` of ``rule`` (an interned rule) with these factors and passthrough."""
        key = (id(rule), factors, passthrough)
        st = self._strategies.get(key)
        if st is None:
            st = self._strategies[key] = OpStrategy(rule, factors, passthrough)
        return st

    def __call__(self, op: Op):
        key = op_key(op)
        rule = self._by_key.get(key) if key is not op else None
        if rule is None:
            rule = rule_for(op)
            rule = self._interned.setdefault(rule, rule)
            if key is not op:
                self._by_key[key] = rule
        return rule


class PlanContext:
    """A graph as both planners read it (see module doc); every part built once."""

    def __init__(self, graph: Graph, book: RuleBook, kernels="xla"):
        self.graph, self.book, self.kernels = graph, book, kernels   # kernels: the cost model's policy
        self._compute: dict = {}   # (id of a cost model, mesh) -> (the model, its ComputeTimes)

    def compute_times(self, cost: CostModel, mesh) -> ComputeTimes:
        """What a strategy costs in compute under ``cost`` on ``mesh`` (``cost.ComputeTimes``),
        one per model and mesh."""
        key = (id(cost), mesh)
        got = self._compute.get(key)
        if got is None or got[0] is not cost:
            got = self._compute[key] = (cost, ComputeTimes(cost, mesh, self.resident, self.rules))
        return got[1]

    @functools.cached_property
    def rules(self) -> dict:
        return {op: self.book(op) for op in self.graph.ops}

    def rule(self, op: Op):
        return self.rules[op]

    @functools.cached_property
    def producers(self) -> dict:
        return self.graph.producers()

    @functools.cached_property
    def users(self) -> dict:
        return self.graph.users()

    @functools.cached_property
    def resident(self) -> frozenset:
        """The values fusion keeps out of memory (``fusion.resident_values``)."""
        return resident_values(self.graph, self.kernels)

    @functools.cached_property
    def stored(self) -> frozenset:
        """The values ``insert-reshards`` gathers once per use, never shared, where a use
        needs them gathered (``insert_reshards.stored_values``: the arguments, their casts
        and views)."""
        return frozenset(stored_values(self.graph))

    @functools.cached_property
    def step_end(self) -> StepEnd:
        """What waits for the step's end (``cost.StepEnd``)."""
        return StepEnd(self.graph)

    @functools.cached_property
    def signatures(self) -> dict:
        """op -> a small int naming its rule, operand types (and which are literals, kept
        out of memory by fusion or terminal) and result types (and which are kept out of
        memory or terminal): everything static propagation's memo keys need, in one
        cheap hash."""
        rules, ids = self.rules, self.book.signature_ids
        resident, terminal = self.resident, self.step_end.terminal
        return {op: ids.setdefault((id(rules[op]), tuple((v.type, v.literal is not None, v in resident, v in terminal)
                                                         for v in op.inputs),
                                    tuple((v.type, v in resident, v in terminal) for v in op.outputs)), len(ids))
                for op in self.graph.ops}

    def layer_token(self, op: Op) -> tuple:
        """Equal for ops that are the same computation on the same types (so the same rule
        and candidates), touching the same tensors in memory, pinned alike: what the
        search's repeated layers are found by."""
        resident = self.resident
        return (op_key(op), tuple((v.literal is not None, v in resident) for v in op.inputs),
                tuple(v in resident for v in op.outputs), op.pinned, op.region is not None)
