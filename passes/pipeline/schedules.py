"""Pipeline schedules: which action each pipeline stage runs, in which order.

A schedule is built from ``p`` stages (ranks along the ``pp`` mesh axis), ``m``
micro-batches and ``v`` chunks per stage, and is nothing more than one ordered list of
:class:`Action` per stage. *When* each action runs (the tick table) is not part of the
schedule: it comes from :func:`shardprop.passes.pipeline.simulate.simulate`, which runs
the orders against durations and the dependencies between stages.

Terms
-----
- **stage** (``d`` in ``0..p-1``): one rank of the ``pp`` axis, a device group that runs
  its own sub-program. ``Action``\\ s are listed per stage.
- **chunk** (``c`` in ``0..v-1``): with ``v > 1`` (interleaved) a stage holds ``v``
  slices of the model. Chunk ``c`` of stage ``d`` is **model stage** ``c*p + d``, so the
  model runs stage 0 chunk 0, stage 1 chunk 0, ..., stage p-1 chunk 0, stage 0 chunk 1,
  ... (Megatron's interleaved assignment; the hop from stage ``p-1`` chunk ``c`` to stage
  0 chunk ``c+1`` is the wrap-around exchange). With ``v == 1`` model stage == stage.
- **kinds**: ``"forward"`` (F), ``"backward"`` (B: the whole backward of one micro-batch
  through one model stage), or its two halves for zero-bubble schedules:
  ``"backward_input"`` (I: the gradient with respect to the stage's input, which the
  previous stage waits for) and ``"backward_weight"`` (W: the gradient with respect to
  the stage's parameters, which nobody waits for, so it can be deferred into bubbles).
  Every (micro-batch, chunk) has exactly one F and either one B or one I and one W on its
  stage; a forward-only (inference) schedule has only the F's.

The schedules
-------------
- ``"gpipe"``: every stage runs F0..F(m-1), then B0..B(m-1). Keeps all ``m``
  micro-batches' activations in flight. Bubble (p-1)/(m+p-1) of the step.
- ``"1f1b"`` (PipeDream-flush / Megatron): stage ``d`` runs ``min(p-d-1, m)`` warm-up
  forwards, then alternates one forward and one backward, then drains the remaining
  backwards. Same bubble as GPipe, but stage ``d`` keeps at most ``min(p-d, m)``
  micro-batches in flight. Any ``m >= 1`` is valid (``m < p`` is correct, just mostly
  bubble).
- ``"interleaved"`` (Megatron's interleaved 1F1B, ``v >= 2`` chunks per stage): the
  ``m*v`` (micro-batch, chunk) forwards are taken in groups of ``p`` micro-batches per
  chunk (virtual index ``k``: chunk ``(k // p) % v``, micro-batch
  ``(k // (p*v))*p + k % p``; backwards walk the chunks in reverse), with
  ``2*(p-d-1) + (v-1)*p`` warm-up forwards on stage ``d``, then 1F1B. Bubble
  (p-1)/(v*m+p-1) when each chunk costs 1/v of a stage; costs ``v`` times the
  exchanges. **Rule: m must be a multiple of p** (Megatron's rule); anything else is a
  ``ShardingError`` naming both numbers and the nearest valid ``m``. ``v == 1`` is
  exactly ``"1f1b"``.
- ``"zero_bubble"`` (ZB-H1, Qi et al. 2024, arXiv 2401.10241; the order Paddle's
  ``pipeline_scheduler_ZBH1`` uses): 1F1B's order with every backward split into I then
  W, where stage ``d`` defers the W of its first ``min(d, m)`` micro-batches to the end
  of its list (filling the tail bubble that 1F1B leaves on later stages). Activations in
  flight (forwarded, input-gradient not yet run) are exactly 1F1B's; stage ``d`` also
  holds up to ``d`` pending weight-gradients. With F = I = W = 1 the idle time is
  (p-1) per stage against 1F1B's 3(p-1) (F=1, B=2): a third. Valid for any ``m >= 1``;
  the 1/3 bound is for ``m >= p``.

How the later passes use this (the interface)
---------------------------------------------
- The **lowering** (one SPMD program over the ``pp`` axis) asks
  ``build_schedule(name, p, m, v)`` and ``simulate(schedule, durations).tick_table``
  (with F = B = I = W = 1 every action is one tick; with the default B = 2 a whole
  backward spans two) and emits a ``lax.scan`` over ticks in which rank ``d`` runs
  ``lax.switch`` over its (kind, chunk) sub-programs for the action at ``(tick, d)``
  (none: a no-op, so bubbles compute nothing), then the neighbour exchanges of that
  tick. ``Schedule.peak_in_flight()`` sizes each stage's activation ring buffer;
  ``Schedule.model_stage(d, c)`` and ``Schedule.neighbours()`` name the exchanges
  (``(d, d+1)`` pairs plus the wrap-around ``(p-1, 0)`` when ``v > 1``).
- The **search** calls :func:`shardprop.passes.pipeline.cuts.plan_cuts` with per-layer
  times and memory from the cost model; it builds schedules here to count the
  activations each stage keeps in flight and simulates them to price the step.
- The **plan / report** shows ``plan.pipeline.schedule`` as the tick table
  (``SimResult.tick_table``: ``(tick, stage) -> Action``) and ``SimResult.render()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ...ir.errors import ShardingError

FORWARD, BACKWARD = "forward", "backward"
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
_LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on one stage: ``kind`` of micro-batch ``microbatch`` through the
    stage's chunk ``chunk`` (model stage ``chunk*p + stage``)."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")

    def __str__(self):   # F3, I3, W3, B3; with a chunk: F3.1
        return f"{_LETTER[self.kind]}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    @property
    def is_backward(self) -> bool:
        """A backward or its input-gradient half: what frees a micro-batch's activations
        and what the previous model stage waits for."""
        return self.kind in (BACKWARD, BACKWARD_INPUT)


@dataclass(frozen=True)
class Schedule:
    """``orders[d]`` is stage ``d``'s actions in the order it runs them."""
    name: str
    p: int
    m: int
    v: int
    orders: tuple

    @property
    def model_stages(self) -> int:
        return self.p * self.v

    def model_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.p + stage

    def placement(self, model_stage: int) -> tuple:
        """(stage, chunk) that runs ``model_stage``."""
        return model_stage % self.p, model_stage // self.p

    @property
    def forward_only(self) -> bool:
        return all(a.kind == FORWARD for order in self.orders for a in order)

    def neighbours(self) -> tuple:
        """The (sender, receiver) stage pairs of forward exchanges (backward ones are the
        reverses): (d, d+1), plus the wrap-around (p-1, 0) when v > 1."""
        pairs = [(model % self.p, (model + 1) % self.p) for model in range(self.model_stages - 1)]
        return tuple(sorted({pair for pair in pairs if pair[0] != pair[1]}))

    def peak_in_flight(self) -> tuple:
        """Per stage, the most (micro-batch, chunk) activations held at once: forwarded but
        whose backward (its input-gradient half for zero-bubble) has not run yet. Read off
        the order alone (a stage runs its list sequentially), so it holds for any
        durations. A forward-only schedule frees each activation after its forward: 1."""
        peaks = []
        for order in self.orders:
            held = peak = 0
            for a in order:
                if a.kind == FORWARD:
                    held += 1
                    peak = max(peak, held)
                    if self.forward_only:
                        held -= 1
                elif a.is_backward:
                    held -= 1
            peaks.append(peak)
        return tuple(peaks)

    def peak_pending_weight(self) -> tuple:
        """Per stage, the most input-gradients run whose weight-gradient has not (0 unless
        the backward is split)."""
        peaks = []
        for order in self.orders:
            held = peak = 0
            for a in order:
                held += (a.kind == BACKWARD_INPUT) - (a.kind == BACKWARD_WEIGHT)
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def validate(self) -> "Schedule":
        """Every (micro-batch, chunk) appears once per stage as F and (unless forward-only)
        as one B or one I and one W; chunk and micro-batch numbers are in range."""
        expect_bwd = not self.forward_only
        if len(self.orders) != self.p:
            raise ShardingError(f"schedule {self.name!r} has {len(self.orders)} stage orders for p={self.p}")
        for d, order in enumerate(self.orders):
            seen = {}
            for a in order:
                if not (0 <= a.microbatch < self.m and 0 <= a.chunk < self.v):
                    raise ShardingError(f"schedule {self.name!r}: stage {d} has {a} out of range "
                                        f"(m={self.m} micro-batches, v={self.v} chunks)")
                key = (a.kind, a.microbatch, a.chunk)
                if key in seen:
                    raise ShardingError(f"schedule {self.name!r}: stage {d} runs {a} twice")
                seen[key] = a
            for i in range(self.m):
                for c in range(self.v):
                    if (FORWARD, i, c) not in seen:
                        raise ShardingError(f"schedule {self.name!r}: stage {d} never runs "
                                            f"{Action(FORWARD, i, c)}")
                    whole = (BACKWARD, i, c) in seen
                    split = [(k, i, c) in seen for k in (BACKWARD_INPUT, BACKWARD_WEIGHT)]
                    if (whole and any(split)) or (any(split) and not all(split)) \
                            or (expect_bwd and not whole and not all(split)):
                        raise ShardingError(
                            f"schedule {self.name!r}: stage {d}, micro-batch {i} chunk {c} needs exactly one "
                            f"backward or one backward_input and one backward_weight")
        return self


def from_orders(orders: Sequence[Iterable[Action]], *, m: int, v: int = 1, name: str = "custom") -> Schedule:
    """A schedule from hand-written per-stage orders (validated for completeness; whether
    it can run is the simulator's question)."""
    orders = tuple(tuple(o) for o in orders)
    return Schedule(name, len(orders), m, v, orders).validate()


def _check(name: str, p: int, m: int, v: int) -> None:
    for label, x in (("p (stages)", p), ("m (micro-batches)", m), ("v (virtual stages)", v)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ShardingError(f"pipeline schedule {name!r}: {label} must be a positive int, got {x!r}")
    if name not in SCHEDULES:
        raise ShardingError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if name != "interleaved" and v != 1:
        raise ShardingError(f"pipeline schedule {name!r} runs one chunk per stage, got virtual_stages={v}; "
                            f"use schedule='interleaved' for v > 1")
    if name == "interleaved" and m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        near = f"{lo} or {hi}" if lo else f"{hi}"
        raise ShardingError(f"pipeline schedule 'interleaved' needs micro-batches divisible by the stages: "
                            f"m={m} is not a multiple of p={p}; use m={near} (or schedule='1f1b')")


def _one_f_one_b(p: int, m: int, d: int, bwd) -> list:
    warm = min(p - d - 1, m)
    order = [Action(FORWARD, i) for i in range(warm)]
    for i in range(m - warm):
        order.append(Action(FORWARD, warm + i))
        order += bwd(i)
    for i in range(m - warm, m):
        order += bwd(i)
    return order


def _interleaved(p: int, m: int, v: int, d: int) -> list:
    total = m * v

    def action(kind, k):
        chunk = (k // p) % v
        if kind != FORWARD:
            chunk = v - 1 - chunk
        return Action(kind, (k // (p * v)) * p + k % p, chunk)

    warm = min(2 * (p - d - 1) + (v - 1) * p, total)
    order = [action(FORWARD, k) for k in range(warm)]
    for i in range(total - warm):
        order += [action(FORWARD, warm + i), action(BACKWARD, i)]
    order += [action(BACKWARD, k) for k in range(total - warm, total)]
    return order


def build_schedule(name: str, p: int, m: int, v: int = 1, *, forward_only: bool = False) -> Schedule:
    """The per-stage action orders of schedule ``name`` for ``p`` stages, ``m``
    micro-batches and ``v`` chunks per stage (``v > 1`` only for ``"interleaved"``).
    ``forward_only`` builds an inference pipeline: each stage runs its forwards in the
    schedule's forward order (no backward, so every schedule is GPipe's forward half)."""
    _check(name, p, m, v)
    orders = []
    for d in range(p):
        if name == "gpipe":
            order = [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)]
        elif name == "1f1b" or (name == "interleaved" and v == 1):
            order = _one_f_one_b(p, m, d, lambda i: [Action(BACKWARD, i)])
        elif name == "interleaved":
            order = _interleaved(p, m, v, d)
        else:   # zero_bubble (ZB-H1)
            deferred = min(d, m)
            order = _one_f_one_b(p, m, d, lambda i: [Action(BACKWARD_INPUT, i)] + (
                [Action(BACKWARD_WEIGHT, i)] if i >= deferred else []))
            order += [Action(BACKWARD_WEIGHT, i) for i in range(deferred)]
        if forward_only:
            order = [a for a in order if a.kind == FORWARD]
        orders.append(tuple(order))
    return Schedule(name, p, m, v, tuple(orders)).validate()
