"""Pass ``bind-user-strategies``: turn the user's strategies into layouts.

Before: ``sharding_constraint`` ops carry the raw strategy of a ``shard()`` call
(split counts, MindSpore style, or mesh axis names, JAX style).
After: every constraint with a strategy has ``pinned`` set to a ``Layout`` on the
graph's mesh, pinned inputs/outputs likewise, and every op inside a ``shard()``
region is checked to accept those layouts without redistribution.

Split counts are bound to mesh axes the way MindSpore builds a device matrix:
the region's factors in order of first appearance over its inputs' dims, each
with its split count, then the repeat count (devices that hold the same slice)
last; each entry takes the next run of mesh axes (major first). So with 8 devices
``((2, 4), (4, 1))`` gives the contracted dim axes ``(d1, d2)``, i.e. groups
``(0,1,2,3)`` and ``(4,5,6,7)``, as in MindSpore's dumps.
"""
from __future__ import annotations

import itertools
import math

from ..ir.errors import sharding_error
from ..ir.graph import CONSTRAINT, Graph, Op
from ..ir.layout import Layout
from ..ir.mesh import Mesh, bind_runs, prime_factors

from .rules import rule_for
from .sharding import OpStrategy, factors_from_operands


class BindUserStrategies:
    name = "bind-user-strategies"

    def __call__(self, graph: Graph) -> Graph:
        regions = self._region_plans(graph)
        if graph.count_mesh:
            graph.set_mesh(self._choose_mesh(graph, regions))
        mesh = graph.mesh
        for rid, plan in regions.items():
            self._bind_region(graph, rid, plan, mesh)
        for i, raw in list(graph.pinned_inputs.items()):
            if not isinstance(raw, Layout):
                graph.pinned_inputs[i] = self._bind_tensor(raw, graph.inputs[i].type.shape, mesh,
                                                           f"in_strategy for input {graph.input_names[i]}",
                                                           (f"parallelize({graph.name})", graph.call_source))
        for i, raw in list(graph.pinned_outputs.items()):
            if not isinstance(raw, Layout):
                graph.pinned_outputs[i] = self._bind_tensor(raw, graph.outputs[i].type.shape, mesh,
                                                            f"out_strategy for output {i}",
                                                            (f"parallelize({graph.name})", graph.call_source))
        for i, layout in graph.pinned_inputs.items():
            graph.inputs[i].layout = layout
        for _, op in graph.walk_ops():
            if op.kind == CONSTRAINT and "user_spec" in op.params:
                op.pinned = self._axes_layout(op.params["user_spec"], op.inputs[0].type.shape, mesh, None,
                                              "its PartitionSpec", ("with_sharding_constraint", op.source))
        return graph

    # -- regions ---------------------------------------------------------------
    def _region_plans(self, graph: Graph) -> dict:
        """Per region: its marks, ops, and (for split counts) the device matrix."""
        plans = {}
        members: dict[int, list[Op]] = {}
        for _, op in graph.walk_ops():   # regions may sit in loop bodies
            if op.region is not None:
                members.setdefault(op.region, []).append(op)
        for rid, region in graph.regions.items():
            every = members.get(rid, [])
            ins = sorted((op for op in every if op.kind == CONSTRAINT and op.params["role"] == "in"),
                         key=lambda o: o.params["index"])
            outs = sorted((op for op in every if op.kind == CONSTRAINT and op.params["role"] == "out"),
                          key=lambda o: o.params["index"])
            body = [op for op in every if op.kind != CONSTRAINT]
            plans[rid] = dict(region=region, ins=ins, outs=outs, body=body, matrix=None)
            strategies = [self._expand_batch(region.in_strategy[m.params["index"]], m) for m in ins]
            plans[rid]["strategies"] = strategies
            if any(kind == "splits" for kind, _ in region.in_strategy):
                plans[rid]["matrix"] = self._device_matrix(graph, plans[rid])
        return plans

    @staticmethod
    def _expand_batch(strategy, mark: Op):
        """A mark under vmap carries the batch dims vmap inserted; those stay unsplit."""
        kind, body = strategy
        body = list(body)
        for d in mark.params.get("batch_dims", ()):
            body.insert(d, 1 if kind == "splits" else ())
        return kind, tuple(body)

    @staticmethod
    def _classes_row(region, mark: Op) -> list:
        """The factor class of each dim of a marked input (None for dims vmap added)."""
        row = list(region.factors.classes[mark.params["index"]])
        for d in mark.params.get("batch_dims", ()):
            row.insert(d, None)
        return row

    def _operator(self, plan) -> str:
        return plan["region"].operator()

    def _device_matrix(self, graph: Graph, plan) -> list[int]:
        """MindSpore's device matrix: the split of each factor (first appearance over the
        inputs' dims) that is split, then the repeat count."""
        region = plan["region"]
        split_of: dict[int, int] = {}
        # read off the region itself (dims vmap added are unsplit), so that a shard() call whose
        # result is unused, and so has no marks left, is checked all the same
        for (kind, body), classes in zip(region.in_strategy, region.factors.classes):
            if kind != "splits":
                continue
            for c, s in zip(classes, body):
                split_of.setdefault(c, s)
        order = sorted(split_of)
        splits = [split_of[c] for c in order]
        plan["class_axes_order"] = [c for c in order if split_of[c] > 1]
        total = math.prod(splits)
        n = graph.mesh.size
        if total > n:
            raise sharding_error(f"the split counts need {total} devices ({' x '.join(str(s) for s in splits if s > 1)})"
                                 f" but the mesh has {n}", operator=self._operator(plan), source=region.source,
                                 shapes=region.in_shapes, strategy=region.user_in_strategy,
                                 fix=f"make the split counts multiply to at most {n} (and divide it)")
        if n % total:
            raise sharding_error(f"the split counts multiply to {total}, which does not divide the {n} devices",
                                 operator=self._operator(plan), source=region.source, shapes=region.in_shapes,
                                 strategy=region.user_in_strategy,
                                 fix=f"make the split counts multiply to a divisor of {n}")
        return [s for s in splits if s > 1] + ([n // total] if n // total > 1 else [])

    def _choose_mesh(self, graph: Graph, plans) -> Mesh:
        """For a device-count mesh, order its prime axes so every device matrix binds."""
        n = graph.mesh.size
        matrices = [p["matrix"] for p in plans.values() if p["matrix"]]
        for raw in list(graph.pinned_inputs.values()) + list(graph.pinned_outputs.values()):
            if not isinstance(raw, Layout) and raw[0] == "splits":
                total = math.prod(raw[1])
                if total <= n and n % total == 0:
                    matrices.append([s for s in raw[1] if s > 1] + ([n // total] if n // total > 1 else []))
        primes = prime_factors(n)
        if len(set(primes)) <= 1:
            return graph.mesh            # every order is the same (also for 1 device)
        for order in sorted(set(itertools.permutations(primes))):
            mesh = Mesh(tuple(f"d{i}" for i in range(len(order))), tuple(order))
            if all(bind_runs(m, mesh) is not None for m in matrices):
                return mesh
        raise sharding_error(f"no arrangement of the {n} devices fits all strategies' device matrices {matrices}",
                             operator="parallelize", fix="use strategies whose split counts nest, or a named mesh "
                             "with PartitionSpec strategies")

    def _check_axes_entries(self, plan, mesh: Mesh) -> None:
        """Every PartitionSpec the user gave this call fits the mesh and its tensor, whether
        or not the call's result is used (unused calls have no marks left to bind)."""
        region = plan["region"]
        for what, strategies, shapes in (("in_strategy", region.in_strategy, region.in_shapes),
                                         ("out_strategy", region.out_strategy or (), region.out_shapes)):
            for k, ((kind, body), shape) in enumerate(zip(strategies, shapes)):
                if kind == "axes":
                    self._axes_layout(body, shape, mesh, plan, f"{what} entry {k}")

    def _bind_region(self, graph: Graph, rid: int, plan, mesh: Mesh) -> None:
        region = plan["region"]
        self._check_axes_entries(plan, mesh)
        layouts: list[Layout] = []
        if plan["matrix"] is not None:
            runs = bind_runs(plan["matrix"], mesh)
            if runs is None:
                raise sharding_error(f"the device matrix {tuple(plan['matrix'])} of these split counts does not "
                                     f"fit the mesh ({mesh}): each split must be a product of consecutive mesh axes",
                                     operator=self._operator(plan), source=region.source, shapes=region.in_shapes,
                                     strategy=region.user_in_strategy,
                                     fix="use PartitionSpec strategies naming the mesh axes, or split counts that "
                                         "follow the mesh axes in order")
            axes_of = dict(zip(plan["class_axes_order"], runs))
        for k, (mark, (kind, body)) in enumerate(zip(plan["ins"], plan["strategies"])):
            shape = mark.outputs[0].type.shape
            if kind == "splits":
                row = self._classes_row(region, mark)
                layout = Layout(tuple(axes_of.get(c, ()) if s > 1 else () for c, s in zip(row, body)))
            else:
                layout = self._axes_layout(body, shape, mesh, plan, f"in_strategy entry {k}")
            mark.pinned = layout
            layouts.append(layout)
        self._check_region_ops(plan, mesh)
        if region.out_strategy is not None:
            for mark in plan["outs"]:
                kind, body = self._expand_batch(region.out_strategy[mark.params["index"]], mark)
                shape = mark.outputs[0].type.shape
                if kind == "axes":
                    mark.pinned = self._axes_layout(body, shape, mesh, plan, f"out_strategy entry {mark.params['index']}")
                else:
                    mark.pinned = self._out_splits_layout(body, mark, mesh, plan)

    def _axes_layout(self, body, shape, mesh: Mesh, plan, which: str, where=None) -> Layout:
        """A PartitionSpec's layout, checked. Errors name the shard() call (``plan``), or
        ``where`` = (operator, source line) for parallelize's own strategies and jax's
        with_sharding_constraint."""
        region = plan["region"] if plan else None
        operator, source = (self._operator(plan), region.source) if plan else where
        shapes, strategy = (region.in_shapes, region.user_in_strategy) if region else (shape, body)
        dims = tuple(body) + ((),) * (len(shape) - len(body))
        for d, axes in enumerate(dims):
            for a in axes:
                if a not in mesh.axis_names:
                    raise sharding_error(f"{which} names mesh axis {a!r}, which the mesh does not have",
                                         operator=operator, source=source, shapes=shapes, strategy=strategy,
                                         fix=f"use one of the mesh axes: {', '.join(mesh.axis_names)}")
        layout = Layout(dims)
        problems = layout.problems(shape, mesh)
        if problems:
            raise sharding_error(f"{which} cannot lay out a tensor of shape {shape}: {'; '.join(problems)}",
                                 operator=operator, source=source, shapes=shapes, strategy=strategy,
                                 fix="use each mesh axis at most once, on dims it divides")
        return layout

    def _out_splits_layout(self, splits, mark: Op, mesh: Mesh, plan) -> Layout:
        """An output's split counts, bound to runs of mesh axes: the result's own
        factor axes first, then the contracted axes (MindSpore's reduce-scatter form)."""
        region = plan["region"]
        producer_axes = plan["result_layouts"].get(mark.inputs[0])
        # each dim first keeps the axes its producer already splits it over (where they
        # fit its count), so that no other dim takes them; then the rest come from the pool
        kept = []
        for d, s in enumerate(splits):
            start = producer_axes.dims[d] if producer_axes is not None else ()
            kept.append(list(start) if mesh.axes_size(start) <= s and s % max(mesh.axes_size(start), 1) == 0 else [])
        dims, used = [], {a for run in kept for a in run}
        for d, s in enumerate(splits):
            run = kept[d]
            pool = ([a for a in producer_axes.partial] if producer_axes is not None else []) + list(mesh.axis_names)
            for a in pool:
                if mesh.axes_size(run) >= s:
                    break
                if a not in run and a not in used and s % (mesh.axes_size(run) * mesh.axis_size(a)) == 0:
                    run.append(a)
            if mesh.axes_size(run) != s:
                raise sharding_error(f"out_strategy split {s} of output dim {d} cannot be built from the mesh axes "
                                     f"({mesh}) left free", operator=self._operator(plan), source=region.source,
                                     shapes=region.out_shapes, strategy=region.user_out_strategy,
                                     fix="use split counts whose product divides the device count")
            used.update(run)
            dims.append(tuple(run))
        layout = Layout(tuple(dims))
        problems = layout.problems(mark.outputs[0].type.shape, mesh)
        if problems:
            raise sharding_error(f"out_strategy {tuple(splits)}: {'; '.join(problems)}", operator=self._operator(plan),
                                 source=region.source, shapes=region.out_shapes, strategy=region.user_out_strategy,
                                 fix="use split counts that divide the output dims")
        return layout

    def _check_region_ops(self, plan, mesh: Mesh) -> None:
        """Every op inside the region must accept the pinned layouts as they are."""
        region = plan["region"]
        known = {m.outputs[0]: m.pinned for m in plan["ins"]}
        plan["result_layouts"] = {}
        for op in plan["body"]:
            rule = rule_for(op)
            factors, problem = factors_from_operands(rule, op, [known.get(v) for v in op.inputs], mesh)
            if problem:
                text, fix = problem
                raise sharding_error(text, operator=f"{op.kind} in {region.describe()}", source=region.source,
                                     shapes=tuple(v.type.shape for v in op.inputs),
                                     strategy=region.user_in_strategy, fix=fix)
            if all(a is not None for a in factors):
                strategy = OpStrategy(rule, tuple(factors))
                for n, v in enumerate(op.outputs):
                    known[v] = plan["result_layouts"][v] = strategy.result_layout(n, mesh)

    def _bind_tensor(self, raw, shape, mesh: Mesh, which: str, where) -> Layout:
        """parallelize's in/out strategy for one tensor; ``where`` = (operator, source line)."""
        kind, body = raw
        if kind == "axes":
            return self._axes_layout(body, shape, mesh, None, which, where)
        operator, source = where
        if len(body) != len(shape):
            raise sharding_error(f"{which} has {len(body)} split counts but the tensor has rank {len(shape)}",
                                 operator=operator, source=source, shapes=shape, strategy=body,
                                 fix=f"give one split count per dimension, {len(shape)} in all")
        for d, (k, n) in enumerate(zip(body, shape)):
            if n % k:
                raise sharding_error(f"{which} splits dim {d} (size {n}) into {k} parts, and {n} is not divisible "
                                     f"by {k}", operator=operator, source=source, shapes=shape, strategy=body,
                                     fix=f"use a split count that divides {n}")
        total = math.prod(body)
        if total > mesh.size or mesh.size % total:
            raise sharding_error(f"{which}: split counts {tuple(body)} need {total} devices; the mesh has {mesh.size}",
                                 operator=operator, source=source, shapes=shape, strategy=body,
                                 fix=f"make the split counts multiply to a divisor of {mesh.size}")
        runs = bind_runs([s for s in body if s > 1], mesh)
        if runs is None:
            raise sharding_error(f"{which}: split counts {tuple(body)} do not fit the mesh ({mesh})",
                                 operator=operator, source=source, shapes=shape, strategy=body,
                                 fix="use a PartitionSpec naming the mesh axes")
        it = iter(runs)
        return Layout(tuple(next(it) if s > 1 else () for s in body))
