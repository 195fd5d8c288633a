"""Which values never reach memory: the kernels a framework runs, as the cost model sees them.

XLA (on CPU and GPU) fuses a chain of elementwise ops, with the broadcasts and
reshapes between them and a reduction at its end, into one loop: only the chain's
inputs are read from memory and only its outputs written. Adam's update is a dozen
elementwise ops per parameter; priced op by op it reads and writes every
intermediate, about five times what the fused loop moves, and a plan that repeats
the update on every device (data parallel) looks far slower than it runs.

A value is *resident* (kept in registers, no bytes touched for it) when the op that
makes it fuses into loops and every op that reads it does too (or is a reduction,
which reads its fused input in the same loop), and it is not an output of its
graph. A value read by a matmul, a collective, a loop or a gather is written to
memory. This is decided on a graph's structure alone: ``cost.tensor_factors`` leaves
resident values out of the bytes an op touches.

That is the ``"xla"`` *kernel policy*, the default. A program written for another
framework ran other kernels: PyTorch launches one kernel per op, except where the
program called a fused kernel. ``KernelPolicy`` names which traced op patterns one
kernel ran (``profiles/kernels-<name>.json``: the patterns and the framework source
that fused each); every other op is its own kernel, reading its operands from memory
and writing its result. The same residency test prices both: a value stays out of
memory only when its producer and every reader are one kernel. ``"unfused"`` is the
far bound (every value in memory). The policy is the cost model's (``CostModel.kernels``,
``sp.Cluster(kernels=...)``): the planners' contexts, the step's price and a pipeline's
stage costs all ask ``resident_values`` with it, so the search picks strategies under the
kernels it is priced with.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..ir.errors import ShardingError
from .rules.elementwise import KINDS as ELEMENTWISE

# ops that only move where elements are read from: a framework's views and implicit
# broadcasts, absorbed by the kernel that reads them (a transpose then read by a
# matmul is the copy a ``.contiguous()`` makes: its reader pays the write)
VIEWS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"})
# ops a compiler fuses into an elementwise loop, as producers or consumers: no
# arithmetic across elements, each output element read from one input position (a
# view only moves where it is read from)
LOOP_FUSIBLE = ELEMENTWISE | VIEWS
# consumers that read a fused producer inside their own loop (an input fusion)
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})

PATTERNS = ("dropout", "bias_dropout_add", "softmax", "layer_norm", "bias_gelu", "optimizer")
KERNEL_SCHEMA = "shardprop.kernels/1"
_PROFILES = Path(__file__).parent / "profiles"


def xla_resident(graph) -> frozenset:
    """The values of ``graph`` (not its loop bodies) that XLA's loop fusion keeps out of memory."""
    readers = graph.users()
    outputs = set(graph.outputs)
    out = set()
    for op in graph.ops:
        if op.kind not in LOOP_FUSIBLE or op.subgraphs:
            continue
        for v in op.outputs:
            users = readers.get(v)
            if users and v not in outputs and all(u.kind in LOOP_FUSIBLE or u.kind in REDUCTIONS
                                                  for u in users):
                out.add(v)
    return frozenset(out)


@dataclass(frozen=True)
class Kernel:
    """One launched kernel: the pattern it was recognised as ("" for an op on its own) and its ops."""
    pattern: str
    ops: tuple


@dataclass(frozen=True)
class KernelPolicy:
    """Which traced ops one kernel runs. ``name``: "xla" (XLA's loop fusion), "unfused"
    (every op its own kernel) or a framework's policy whose ``patterns`` (of
    ``PATTERNS``) were fused kernels, every other op launched on its own."""
    name: str
    patterns: tuple = ()
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def resident(self, graph) -> frozenset:
        """The values of ``graph`` that no kernel writes to memory."""
        if self.name == "xla":
            return xla_resident(graph)
        if self.name == "unfused":
            return frozenset()
        return _Framework(graph, self.patterns).resident()

    def kernels(self, graph) -> list:
        """``graph``'s ops as the kernels this policy launches (``Kernel``s, program order
        of their first op); views absorbed into a reader are their own entry."""
        if self.name == "xla":
            return _components(graph, xla_resident(graph))
        if self.name == "unfused":
            return [Kernel("", (op,)) for op in graph.ops]
        return _Framework(graph, self.patterns).kernels()


def _components(graph, resident) -> list:
    """XLA's kernels: ops joined through the values fusion keeps out of memory."""
    parent = {op: op for op in graph.ops}

    def find(op):
        while parent[op] is not op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op
    producers, readers = graph.producers(), graph.users()
    for v in resident:
        a = find(producers[v])
        for u in readers.get(v, ()):
            b = find(u)
            if a is not b:
                parent[b] = a
    groups: dict = {}
    for op in graph.ops:
        groups.setdefault(find(op), []).append(op)
    return [Kernel("", tuple(g)) for g in groups.values()]


@functools.lru_cache(maxsize=8)   # (a policy file read once per name)
def builtin_policy(name: str) -> KernelPolicy:
    """"xla", "unfused" or a framework's policy from ``profiles/kernels-<name>.json``."""
    if name in ("xla", "unfused"):
        return KernelPolicy(name)
    path = _PROFILES / f"kernels-{name}.json"
    if not path.exists():
        known = ["xla", "unfused"] + sorted(p.stem[len("kernels-"):] for p in _PROFILES.glob("kernels-*.json"))
        raise ShardingError(f"no kernel policy {name!r}; the built-in ones are {known}")
    data = json.loads(path.read_text())
    if data.get("schema") != KERNEL_SCHEMA:
        raise ShardingError(f"{path.name} is not a kernel policy (schema {data.get('schema')!r})")
    fused = data.get("fused", {})
    unknown = sorted(set(fused) - set(PATTERNS))
    if unknown:
        raise ShardingError(f"{path.name}: unknown patterns {unknown}; known: {list(PATTERNS)}")
    return KernelPolicy(data["name"], tuple(p for p in PATTERNS if p in fused),
                        {k: v.get("source", "") for k, v in fused.items()})


def policy_for(kernels) -> KernelPolicy:
    """A ``KernelPolicy`` from a policy or a built-in name."""
    return kernels if isinstance(kernels, KernelPolicy) else builtin_policy(kernels)


def resident_values(graph, kernels="xla") -> frozenset:
    """The values of ``graph`` (not its loop bodies) that stay out of memory under
    ``kernels`` (a ``KernelPolicy`` or a built-in name; a cost model's is ``cost.kernels``)."""
    return policy_for(kernels).resident(graph)


# -- a framework's kernels, recognised on the traced graph ------------------------------------------

_MASK_CHAIN = frozenset({"ge", "gt", "le", "lt", "convert_element_type", "broadcast_in_dim", "reshape"})


class _Framework:
    """A framework that launches one kernel per op except its fused patterns: each
    pattern found on the graph (its forward ops) becomes one kernel, and so does its
    backward (the ops reading what the forward kernel computed, and the ops between them);
    views join the kernel that reads them; every other op is a kernel of its own.

    A fused kernel saves its inputs or outputs for the backward (Megatron's softmax its
    probabilities, apex's layer norm its input and row statistics) and its backward
    recomputes the rest in registers, where the traced backward reads the forward's
    intermediates (``exp``, the centred input in float32): those stay out of memory. The
    backward's read of the saved tensor is then not priced where the traced backward does
    not read it (a softmax's probabilities: one read of the attention matrix)."""

    def __init__(self, graph, patterns):
        self.graph, self.patterns = graph, set(patterns)
        self.producer, self.readers = graph.producers(), graph.users()
        self.outputs = set(graph.outputs)
        self.label: dict = {}          # op -> kernel index
        self.found: list = []          # [(pattern, [ops])]
        self.backward: dict = {}       # forward kernel index -> its backward kernel's
        self.order = {op: i for i, op in enumerate(graph.ops)}
        self._recognise()

    # structure
    def _fusible(self, op) -> bool:
        return (op is not None and not op.subgraphs and op.kind not in VIEWS
                and (op.kind in LOOP_FUSIBLE or op.kind in REDUCTIONS))

    def _free(self, op) -> bool:
        return self._fusible(op) and op not in self.label

    def _source(self, v):
        """The op that computes ``v``, looking through views."""
        op = self.producer.get(v)
        while op is not None and op.kind in VIEWS and op.inputs:
            op = self.producer.get(op.inputs[0])
        return op

    def _reads(self, v) -> list:
        """The ops reading ``v``, looking through views (None for a view that is an output)."""
        out = []
        for u in self.readers.get(v, ()):
            if u.kind in VIEWS and not u.subgraphs:
                for w in u.outputs:
                    out.extend([None] if w in self.outputs else self._reads(w))
            else:
                out.append(u)
        return out

    def _claim(self, pattern, ops) -> int:
        k = len(self.found)
        ops = [op for op in ops if op not in self.label]
        self.found.append((pattern, ops))
        for op in ops:
            self.label[op] = k
        return k

    def _ancestors(self, op, limit=256) -> set:
        """``op`` and the free fusible ops it computes from, through views; not a cast of
        the step's arguments alone (the model's fp16 copy of a parameter: a kernel of its own)."""
        seen, stack = {op}, [op]
        while stack and len(seen) < limit:
            for v in stack.pop().inputs:
                p = self._source(v)
                if p is None or p in seen:
                    continue
                if p.kind == "iota" or self._free(p) and any(self._source(w) is not None
                                                             for w in p.inputs if w.literal is None):
                    seen.add(p)
                    stack.append(p)
        return seen

    # the patterns, forward first (in program order), then each one's backward
    def _recognise(self):
        forward = []
        if self.patterns & {"dropout", "bias_dropout_add"}:
            for op in self.graph.ops:
                if op.kind == "select_n" and op not in self.label and self._random_mask(op.inputs[0]):
                    forward.append(self._dropout(op))
        for op in self.graph.ops:
            if op.kind == "exp" and "softmax" in self.patterns and op not in self.label:
                out = self._normalised(op)
                if out is not None:
                    forward.append(self._claim("softmax", self._ancestors(out)))
        for op in self.graph.ops:   # layer norm and bias + gelu: what a matmul reads
            if op.subgraphs or self._fusible(op) or op.kind in VIEWS:
                continue
            for v in op.inputs:
                p = self._source(v)
                if p is None or not self._free(p):
                    continue
                region = self._ancestors(p)
                kinds = {o.kind for o in region}
                if "rsqrt" in kinds and "layer_norm" in self.patterns:
                    forward.append(self._claim("layer_norm", region))
                elif "tanh" in kinds and "bias_gelu" in self.patterns:
                    forward.append(self._claim("bias_gelu", region))
        for k in forward:
            self._backward(k)
        if "optimizer" in self.patterns:
            self._optimizer()

    def _random_mask(self, v, depth=6) -> bool:
        op = self.producer.get(v)
        while op is not None and depth:
            if op.kind == "random_bits":
                return True
            if op.kind not in _MASK_CHAIN:
                return False
            op, depth = self.producer.get(op.inputs[0]), depth - 1
        return False

    def _dropout(self, select) -> int:
        """Dropout (PyTorch's fused dropout: random bits, mask and scaling in one kernel);
        with ``bias_dropout_add``, also the bias added before it and the residual added after."""
        ops = [select]
        op = self.producer.get(select.inputs[0])
        while op is not None and op.kind in _MASK_CHAIN | {"random_bits"} and op not in self.label:
            ops.append(op)
            op = self.producer.get(op.inputs[0]) if op.kind != "random_bits" else None
        data = []
        for v in select.inputs[1:]:
            p = self.producer.get(v)
            if p is None or p in self.label:
                continue
            if p.kind == "broadcast_in_dim" and all(w.literal is not None for w in p.inputs):
                ops.append(p)                       # the zeros
            elif p.kind in ("div", "mul") and self._only_reader(v, select) and _scaled(p):
                ops.append(p)                       # x / (1 - p)
                data.append(p.inputs[0])
            else:
                data.append(v)
        out = select.outputs[0]
        after = self.readers.get(out, [])
        if len(after) == 1 and after[0].kind in ("div", "mul") and _scaled(after[0]) and after[0] not in self.label:
            ops.append(after[0])                    # the backward's g * mask / (1 - p)
            out = after[0].outputs[0]
        pattern = "dropout"
        if "bias_dropout_add" in self.patterns:
            for v in data:                          # y + bias (a rank-1 parameter broadcast)
                p = self.producer.get(v)
                if (p is not None and p.kind == "add" and p not in self.label and self._only_reader(v, *ops)
                        and any(self._is_bias(w) for w in p.inputs)):
                    ops.append(p)
                    pattern = "bias_dropout_add"
            after = self.readers.get(out, [])
            if after and all(u.kind == "add" and u not in self.label for u in after):
                ops.extend(after)                   # + residual
                pattern = "bias_dropout_add"
        return self._claim(pattern, ops)

    def _is_bias(self, v) -> bool:
        p = self.producer.get(v)
        return p is not None and p.kind == "broadcast_in_dim" and len(p.inputs[0].type.shape) == 1

    def _only_reader(self, v, *ops) -> bool:
        return v not in self.outputs and all(u in ops for u in self.readers.get(v, ()))

    def _normalised(self, exp):
        """The ``div`` that divides ``exp``'s result by its own sum (a softmax), or None."""
        def through_converts(v):
            out = [v]
            for u in self.readers.get(v, ()):
                if u.kind == "convert_element_type":
                    out.extend(through_converts(u.outputs[0]))
            return out
        values = through_converts(exp.outputs[0])
        sums = {u.outputs[0] for v in values for u in self.readers.get(v, ()) if u.kind == "reduce_sum"}
        for v in values:
            for u in self.readers.get(v, ()):
                if u.kind == "div" and u.inputs[0] is v:
                    d = u.inputs[1]
                    while self.producer.get(d) is not None and self.producer[d].kind in (
                            "broadcast_in_dim", "reshape", "convert_element_type"):
                        d = self.producer[d].inputs[0]
                    if d in sums:
                        return u
        return None

    def _backward(self, k):
        """The kernel that differentiates forward kernel ``k``: the free fusible ops reading
        a value it computed (what the forward saved), the free ops on paths between them
        and the free ops computed from them and the forward's values alone (so an autograd
        accumulation inside the kernel is in it; one adding another kernel's gradient is not).
        Dropout has none: its backward is a masked scale, found as a dropout of its own."""
        pattern, region = self.found[k]
        if pattern in ("dropout", "bias_dropout_add"):
            return
        made = {v for op in region for v in op.outputs}
        seeds = {u for v in made for u in self._reads(v) if u is not None and self._free(u)}
        if not seeds:
            return
        hi = max(self.order[m] for m in seeds)
        below, stack = set(seeds), list(seeds)       # computed from a seed, before the last seed
        while stack:
            for v in stack.pop().outputs:
                for u in self._reads(v):
                    if u is not None and u not in below and self._free(u) and self.order[u] <= hi:
                        below.add(u)
                        stack.append(u)
        members, stack = set(seeds), list(seeds)     # ... and reaching a seed
        while stack:
            for v in stack.pop().inputs:
                p = self._source(v)
                if p in below and p not in members:
                    members.add(p)
                    stack.append(p)
        stack = list(members)                        # computed from the kernel's values alone
        while stack:
            for v in stack.pop().outputs:
                for u in self._reads(v):
                    if u is None or u in members or not self._free(u):
                        continue
                    srcs = [self._source(w) for w in u.inputs if w.literal is None]
                    if all(p in members or p in region for p in srcs):
                        members.add(u)
                        stack.append(u)
        self.backward[k] = self._claim(pattern + " backward", sorted(members, key=self.order.get))

    def _optimizer(self):
        """The optimizer's update: the free elementwise ops whose results only the step's
        outputs depend on, through fused tail ops alone (the tail ``cost.terminal_values``
        finds; that module imports this one), as one multi-tensor kernel."""
        tail: set = set()
        for op in reversed(self.graph.ops):
            tail.update(v for v in op.outputs
                        if all((u.kind in LOOP_FUSIBLE or u.kind in REDUCTIONS) and not u.subgraphs
                               and all(w in tail for w in u.outputs) for u in self.readers.get(v, ())))
        ops = [op for op in self.graph.ops if self._free(op) and op.outputs and all(v in tail for v in op.outputs)]
        if ops:
            self._claim("optimizer", ops)

    # what the kernels keep out of memory
    def resident(self) -> frozenset:
        xla = xla_resident(self.graph)
        out = set()
        for op in self.graph.ops:
            if op.subgraphs:
                continue
            for v in op.outputs:
                if v in self.outputs or not self.readers.get(v):
                    continue
                if op.kind in VIEWS:
                    if v in xla:
                        out.add(v)             # a view: read where its reader reads it
                    continue
                k = self.label.get(op)
                if k is None:
                    continue
                # one kernel's value, or a forward kernel's value only its own backward reads
                # besides: the framework's backward recomputes it from the tensors it saved
                ks = (k, self.backward.get(k, k))
                readers = self._reads(v)
                if readers and all(u is not None and self.label.get(u) in ks for u in readers):
                    out.add(v)
        return frozenset(out)

    def kernels(self) -> list:
        out = [Kernel(p, tuple(sorted(ops, key=self.order.get))) for p, ops in self.found if ops]
        out += [Kernel("", (op,)) for op in self.graph.ops if op not in self.label]
        return sorted(out, key=lambda k: self.order[k.ops[0]])


def _scaled(op) -> bool:
    """A multiply or divide by a scalar literal (dropout's 1 / (1 - p))."""
    return any(v.literal is not None or not v.type.shape for v in op.inputs[1:])


def unwritten_values(graph) -> frozenset:
    """The resident values that never get a buffer of their own: those with one reader,
    which fusion computes inside that reader's loop. A resident value with several
    readers (a forward value the backward reads again) is computed once and written
    where the readers land in different fusions, which the structure alone does not say."""
    readers = graph.users()
    return frozenset(v for v in resident_values(graph) if len(readers[v]) == 1)
