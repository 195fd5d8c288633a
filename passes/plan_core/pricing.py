"""One price of a move: what taking a value from one layout to another costs.

Every planner prices moves here: propagation's choices and plan rounds, the
search's problem, its refinement and the plan evaluator. A move is priced by the
redistribution planner (``redistribute.redistribution_cost``) under the model that
prices moving that value: a *terminal* value (a gradient on its way to the
update) rides in one launch with the others at the step's end
(``cost.StepEnd.cost_for``). A move that would create a partial, or a layout that
does not fit the tensor, is ``cost.IMPOSSIBLE``; a move that only slices is free.

Memoized as a layer around that pure function, keyed by what it reads. The
redistribution planner solves each move on a *virtual* mesh: the axes that sit
together in both layouts are bundled into one (``redistribute._bundles``), and its
answer depends on nothing else than that virtual problem (the tensor's bytes and
which products of mesh axes divide each of its dims, virtual layouts, bundle sizes)
and, with a calibrated profile, the rank geometry of each bundle (a profile prices
device groups by the ranks they span: ``cost.group_shape``). Two moves with the same virtual problem and geometry cost the
same, so they are priced once: within a mesh (moves that differ only in which axes
they name), and across the arrangements of a device-count mesh the search tries.
"""
from __future__ import annotations

import math
from typing import Optional

from ...ir.layout import Layout
from ...ir.mesh import Mesh

from ..cost import IMPOSSIBLE, CostModel, StepEnd
from ..insert_reshards import cheapest_completion
from ..redistribute import plan_redistribution, virtual_move_cost, virtual_problem


class Prices:
    """Seconds of a move: ``move`` and ``completion`` for a value of a graph (see
    module doc); ``__call__`` for a tensor, memoized by its virtual problem."""

    def __init__(self, cost: CostModel, allow_reduce_scatter: bool = True):
        self.cost, self.allow_rs = cost, allow_reduce_scatter
        self._by_virtual: dict = {}
        self._strides: dict = {}
        self._moves: dict = {}
        self._completions: dict = {}

    def cost_for(self, step_end: StepEnd, v) -> CostModel:
        """The model that prices moving ``v`` (``cost.StepEnd.cost_for``)."""
        return step_end.cost_for(self.cost, v)

    def move(self, v, src: Layout, dst: Layout, mesh: Mesh, step_end: StepEnd) -> float:
        """Seconds to take value ``v`` from ``src`` to ``dst``."""
        if src is dst or src == dst:
            return 0.0
        terminal = v in step_end.terminal
        key = (v.type, terminal, src, dst, mesh)
        t = self._moves.get(key)
        if t is None:
            shape = tuple(v.type.shape)
            if not set(dst.partial) <= set(src.partial):
                t = IMPOSSIBLE   # nothing makes a partial value
            elif not src.fits(shape, mesh) or not dst.fits(shape, mesh):
                t = IMPOSSIBLE
            elif not src.partial and not dst.partial and all(d[:len(s)] == s for s, d in zip(src.dims, dst.dims)):
                t = 0.0          # only slicing: no communication
            else:
                try:
                    t = self(shape, v.type.itemsize, src, dst, mesh, step_end.riders if terminal else None)
                except ValueError:   # no redistribution reaches it
                    t = IMPOSSIBLE
            self._moves[key] = t
        return t

    def completion(self, v, layout: Layout, mesh: Mesh, step_end: StepEnd) -> tuple[Layout, float]:
        """(layout, seconds) of completing ``v``'s pending partial the cheapest way
        (``insert_reshards.cheapest_completion``): what an output nobody pins costs."""
        if not layout.partial:
            return layout, 0.0
        key = (v.type, v in step_end.terminal, layout, mesh)
        out = self._completions.get(key)
        if out is None:
            if not layout.fits(tuple(v.type.shape), mesh):
                out = (layout, IMPOSSIBLE)
            else:
                out = cheapest_completion(v.type.shape, v.type.itemsize, layout, mesh, self.allow_rs,
                                          self.cost_for(step_end, v))
            self._completions[key] = out
        return out

    def output(self, graph, i: int, have: Layout, input_layout, mesh: Mesh, step_end: StepEnd) -> tuple[Layout, float]:
        """(layout, seconds) of handing output ``i`` of ``graph`` back from ``have``: to its
        pinned layout, to its argument's layout (returned state; ``input_layout(j)``:
        argument j's layout in the plan), else completed the cheapest way."""
        v = graph.outputs[i]
        target = graph.pinned_outputs.get(i)
        if target is None and i in graph.tied_outputs:
            target = input_layout(graph.tied_outputs[i])
        if target is None:
            return self.completion(v, have, mesh, step_end)
        return target, self.move(v, have, target, mesh, step_end)

    def wire_bytes(self, v, src: Layout, dst: Layout, mesh: Mesh, step_end: StepEnd) -> float:
        """Bytes on the wire of the move's steps."""
        if src == dst:
            return 0.0
        steps = plan_redistribution(tuple(v.type.shape), v.type.itemsize, src, dst, mesh, self.allow_rs,
                                    self.cost_for(step_end, v))
        return sum(s.wire_bytes for s in steps)

    def __call__(self, shape: tuple, itemsize: int, src: Layout, dst: Layout, mesh: Mesh,
                 riders: Optional[int] = None) -> float:
        """Seconds of a redistribution of a tensor; ``riders``: for a terminal value, how
        many reductions share its launch (``CostModel.at_step_end``); None for any other."""
        virtual = virtual_problem(src, dst, mesh)   # (a ValueError where it would create a partial)
        members, vsrc, vdst, vmesh = virtual
        geometry = None
        if self.cost.prices_groups:   # a profile (a cluster) prices a group by the ranks it spans
            strides = self._axis_strides(mesh)
            geometry = tuple(tuple((mesh.axis_size(a), strides[a]) for a in c) for c in members.values())
        # the tensor as the planner reads it: its bytes, and which mesh-axis products divide
        # each dim (``gcd(dim, devices)``: every product of distinct axes divides the device
        # count). Tensors alike in both are the same search, step for step: on the 2-layer
        # GPT step 10,037 moves of 22 shapes are 7,236 such searches
        tensor = (tuple(math.gcd(n, mesh.size) for n in shape), math.prod(shape), itemsize)
        key = (tensor, vsrc, vdst, vmesh.axis_sizes, geometry, riders)
        t = self._by_virtual.get(key)
        if t is None:
            cost = self.cost if riders is None else self.cost.at_step_end(riders)
            t = self._by_virtual[key] = virtual_move_cost(shape, itemsize, src, dst, mesh, virtual, self.allow_rs,
                                                          cost)
        return t

    def _axis_strides(self, mesh: Mesh) -> dict:
        strides = self._strides.get(mesh)
        if strides is None:   # ranks are row-major over the mesh axes
            sizes = mesh.axis_sizes
            strides = self._strides[mesh] = {a: math.prod(sizes[i + 1:]) for i, a in enumerate(mesh.axis_names)}
        return strides
