"""scan / while / cond: one rule for the whole loop or branch, summarised from its body.

Dims of the op's operands and results are joined into factors through the body:
a loop carry's dims are the same factors going in and coming out (so a carry
keeps one layout through the loop), and so is every dim the body's own rules
connect to them. The iteration dim of a scan's stacked inputs and outputs must
stay whole. The body itself is partitioned separately, with its boundary fixed
to the layouts chosen here (``propagate-sharding`` recurses into it).
"""
from __future__ import annotations

from ...ir.graph import Value

from .base import FactorBuilder, FactorRule, register
from .dim_classes import DimClasses


class _Factors:
    def __init__(self, classes: DimClasses):
        self.classes = classes
        self.fb = FactorBuilder()
        self.of_root: dict = {}
        self.repeated: set = set()   # factors that ended up on two dims of one tensor

    def rule(self, operands, results, need=frozenset(), flops=0.0) -> FactorRule:
        """A factor the body joins across two dims of one tensor (a carry whose dims
        trade places each iteration) cannot be laid out consistently: keep it whole."""
        for t in list(operands) + list(results):
            seen = [f for dim in t for f in dim]
            self.repeated.update(f for f in seen if seen.count(f) > 1)
        return FactorRule(tuple(self.fb.sizes), tuple(operands), tuple(results),
                          need_replication=frozenset(need) | frozenset(self.repeated), flops=flops)

    def dim(self, v: Value, d: int) -> tuple:
        if v.type.shape[d] == 1:
            return ()
        root = self.classes.find((v.id, d))
        if root not in self.of_root:
            self.of_root[root] = self.fb.new(v.type.shape[d])
        return (self.of_root[root],)

    def tensor(self, v: Value, skip_leading: bool = False) -> tuple:
        start = 1 if skip_leading else 0
        return tuple(self.dim(v, d) for d in range(start, v.type.rank))


@register("scan")
def scan_rule(op) -> FactorRule:
    body = op.subgraphs[0]
    nc, ncarry = op.params["num_consts"], op.params["num_carry"]
    classes = DimClasses()
    classes.add_ops(body.ops)
    classes.tie(body.inputs[nc:nc + ncarry], body.outputs[:ncarry])
    fx = _Factors(classes)
    steps = fx.fb.new(op.params["length"]) if op.params["length"] > 1 else None
    lead = (steps,) if steps is not None else ()
    operands = [fx.tensor(b) for b in body.inputs[:nc + ncarry]]
    operands += [(lead,) + fx.tensor(b) for b in body.inputs[nc + ncarry:]]
    results = [fx.tensor(b) for b in body.outputs[:ncarry]]
    results += [(lead,) + fx.tensor(b) for b in body.outputs[ncarry:]]
    need = frozenset({steps} if steps is not None else ())
    return fx.rule(operands, results, need, classes.flops * op.params["length"])


@register("while")
def while_rule(op) -> FactorRule:
    cond, body = op.subgraphs
    nc, nb = op.params["cond_nconsts"], op.params["body_nconsts"]
    classes = DimClasses()
    classes.add_ops(cond.ops)
    classes.add_ops(body.ops)
    classes.tie(body.inputs[nb:], body.outputs)
    classes.tie(cond.inputs[nc:], body.inputs[nb:])
    fx = _Factors(classes)
    operands = [fx.tensor(v) for v in cond.inputs[:nc]] + [fx.tensor(v) for v in body.inputs[:nb]]
    operands += [fx.tensor(v) for v in body.inputs[nb:]]
    results = [fx.tensor(v) for v in body.outputs]
    return fx.rule(operands, results, flops=classes.flops)


@register("cond")
def cond_rule(op) -> FactorRule:
    branches = op.subgraphs
    classes = DimClasses()
    for b in branches:
        classes.add_ops(b.ops)
    for b in branches[1:]:
        classes.tie(branches[0].inputs, b.inputs)
        classes.tie(branches[0].outputs, b.outputs)
    fx = _Factors(classes)
    operands = [()] + [fx.tensor(v) for v in branches[0].inputs]
    results = [fx.tensor(v) for v in branches[0].outputs]
    return fx.rule(operands, results, flops=classes.flops)
