"""Redistribution prices shared by every mesh arrangement a search tries.

The redistribution planner solves each move on a *virtual* mesh: the axes that sit
together in both layouts are bundled into one (``redistribute._bundles``), and
the search runs over the bundles. Its answer depends on nothing else than that
virtual problem (tensor shape, virtual layouts, bundle sizes) and, with a
calibrated profile, the rank geometry of each bundle (a profile prices device
groups by the ranks they span: ``cost.group_shape``). Two moves with the same
virtual problem and geometry cost the same, so they are priced once: within a
mesh (moves that differ only in which axes they name), and across the
arrangements of a device-count mesh (a 4-way move on 2 x 4's minor axis is the
same as on 4 x 2's major one under a model that prices groups by size alone).
"""
from __future__ import annotations

from typing import Optional

import math

from ...ir.layout import Layout
from ...ir.mesh import Mesh

from ..cost import CostModel
from ..redistribute import _bundles, _to_virtual, redistribution_cost


class Prices:
    """Seconds of a redistribution, memoized by its virtual problem (see module doc)."""

    def __init__(self, cost: CostModel, allow_reduce_scatter: bool):
        self.cost, self.allow_rs = cost, allow_reduce_scatter
        self._by_virtual: dict = {}
        self._strides: dict = {}

    def __call__(self, shape: tuple, itemsize: int, src: Layout, dst: Layout, mesh: Mesh,
                 riders: Optional[int] = None) -> float:
        """``riders``: for a terminal value, how many reductions share its launch
        (``CostModel.at_step_end``); None for any other value."""
        chains = _bundles(src, dst, mesh)
        name_of = {a: f"v{i}" for i, c in enumerate(chains) for a in c}
        sizes = tuple(mesh.axes_size(c) for c in chains)
        vmesh = Mesh(tuple(f"v{i}" for i in range(len(chains))), sizes)
        geometry = None
        if self.cost.links:   # a profile prices a group by the ranks it spans
            strides = self._axis_strides(mesh)
            geometry = tuple(tuple((mesh.axis_size(a), strides[a]) for a in c) for c in chains)
        key = (shape, itemsize, _to_virtual(src, name_of, vmesh), _to_virtual(dst, name_of, vmesh), sizes, geometry,
               riders)
        t = self._by_virtual.get(key)
        if t is None:
            cost = self.cost if riders is None else self.cost.at_step_end(riders)
            t = self._by_virtual[key] = redistribution_cost(shape, itemsize, src, dst, mesh, self.allow_rs, cost)
        return t

    def _axis_strides(self, mesh: Mesh) -> dict:
        strides = self._strides.get(mesh)
        if strides is None:   # ranks are row-major over the mesh axes
            sizes = mesh.axis_sizes
            strides = self._strides[mesh] = {a: math.prod(sizes[i + 1:]) for i, a in enumerate(mesh.axis_names)}
        return strides
