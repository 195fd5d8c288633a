"""Where a loop or branch body meets the op that holds it: which of the op's
operands/results each body input/output is, and the layouts the op's strategy
gives them (``propagate-sharding`` pins a body's boundary with these)."""
from __future__ import annotations

from ..ir.graph import Op
from ..ir.layout import Layout


def boundary_pairs(op: Op):
    """For each body of a loop/branch op: (side, index of the op's operand/result,
    position among the body's inputs/outputs, body value, whether the op's tensor has
    a leading iteration dim). A body may return one value at several positions (a
    scan's new carry that is also a residual for the backward), so the position, not
    the value, says which output is meant."""
    if op.kind == "scan":
        body = op.subgraphs[0]
        nc, ncarry = op.params["num_consts"], op.params["num_carry"]
        pairs = [("operand", i, i, v, i >= nc + ncarry) for i, v in enumerate(body.inputs)]
        pairs += [("result", i, i, v, i >= ncarry) for i, v in enumerate(body.outputs)]
        yield body, pairs
    elif op.kind == "while":
        cond, body = op.subgraphs
        nc, nb = op.params["cond_nconsts"], op.params["body_nconsts"]
        carry = len(body.outputs)
        yield cond, [("operand", i, i, v, False) for i, v in enumerate(cond.inputs[:nc])] + \
            [("operand", nc + nb + i, nc + i, v, False) for i, v in enumerate(cond.inputs[nc:])]
        yield body, [("operand", nc + i, i, v, False) for i, v in enumerate(body.inputs)] + \
            [("result", i, i, v, False) for i, v in enumerate(body.outputs[:carry])]
    elif op.kind == "cond":
        for b in op.subgraphs:
            yield b, [("operand", i + 1, i, v, False) for i, v in enumerate(b.inputs)] + \
                [("result", i, i, v, False) for i, v in enumerate(b.outputs)]


def boundary_layouts(op: Op, mesh):
    """The layouts a body's inputs arrive in and its outputs must leave in, from the
    op's strategy (a while's condition returns a replicated scalar)."""
    for body, pairs in boundary_pairs(op):
        pins_in, pins_out = {}, {}
        for side, n, pos, _, lead in pairs:
            if side == "operand":
                layout = op.strategy.operand_layout(n, op.inputs[n].type.rank, mesh)
            else:
                layout = op.strategy.result_layout(n, mesh)
            layout = Layout(layout.dims[1:] if lead else layout.dims)
            (pins_in if side == "operand" else pins_out)[pos] = layout
        if op.kind == "while" and body is op.subgraphs[0]:
            pins_out[0] = Layout(())
        yield body, pins_in, pins_out
