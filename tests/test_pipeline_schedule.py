"""Pipeline schedules and their simulator (issue 26): bubble formulas, activations in
flight, zero-bubble's third, deadlock detection, and every dependency respected in the
tick table, checked here by code that shares nothing with the simulator."""
from collections import Counter
from fractions import Fraction as Fr

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardprop.ir.errors import ShardingError
from shardprop.passes.pipeline import (Action, DeadlockError, build_schedule, from_orders,
                                       simulate)

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
UNIT_FB = {"forward": 1, "backward": 1}            # F = B = 1
UNIT = None                                        # the default: F = 1, B = 2, I = W = 1

ps = st.integers(1, 8)
ms = st.integers(1, 32)


@st.composite
def valid_configs(draw):
    """(name, p, m, v) over p in 1..8, m in 1..32, v in 1..4 where valid."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble"]))
    p = draw(ps)
    if name == "interleaved":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, 32 // p))
    else:
        v, m = 1, draw(ms)
    return name, p, m, v


# ---- an independent checker: reads only the tick table and the schedule's parameters ----

def _bwd_kinds(kind):
    return kind in ("backward", "backward_input")


def check_tick_table(table, p, m, v, orders, ticks_of, lat_ticks=0, forward_only=False):
    """Every dependency and every stage's order respected in ``table`` ((tick, stage) ->
    Action); each (kind, micro-batch, chunk) exactly once per stage; each action occupies
    exactly ``ticks_of(kind)`` consecutive ticks. Returns per-stage peak activations held
    (forwarded, backward not started), measured over time."""
    slots = {}                                   # (stage, action) -> sorted ticks
    for (t, d), a in table.items():
        slots.setdefault((d, a), []).append(t)
    first, last = {}, {}
    for (d, a), ts in slots.items():
        ts.sort()
        assert ts == list(range(ts[0], ts[0] + ticks_of(a, d))), (d, a, ts)
        first[(d, a)], last[(d, a)] = ts[0], ts[-1]

    S = p * v
    where = {}                                   # (kind group, microbatch, model stage) -> (stage, action)
    for d in range(p):
        per_stage = Counter((a.kind, a.microbatch, a.chunk) for (dd, a) in slots if dd == d)
        want = Counter()
        for i in range(m):
            for c in range(v):
                want[("forward", i, c)] = 1
        kinds = {a.kind for (dd, a) in slots if dd == d}
        assert "forward" in kinds
        if not forward_only:
            assert kinds - {"forward"} in ({"backward"}, {"backward_input", "backward_weight"},
                                           {"backward", "backward_input", "backward_weight"})
            for i in range(m):
                for c in range(v):
                    if ("backward", i, c) in per_stage:
                        want[("backward", i, c)] = 1
                    else:
                        want[("backward_input", i, c)] = want[("backward_weight", i, c)] = 1
        assert per_stage == want, (d, per_stage - want, want - per_stage)
        # the stage ran its list in its order
        ran = sorted((first[(d, a)], a) for (dd, a) in slots if dd == d)
        assert [a for _, a in ran] == list(orders[d])
        for (dd, a) in slots:
            if dd == d:
                s = a.chunk * p + d
                group = "bwd" if _bwd_kinds(a.kind) else a.kind
                where[(group, a.microbatch, s)] = (d, a)

    def after(x, y, hop):                         # x starts after y ended (+ exchange ticks)
        gap = lat_ticks if hop else 0
        assert first[x] >= last[y] + 1 + gap, (x, y, first[x], last[y])

    for (d, a) in slots:
        s, i = a.chunk * p + d, a.microbatch
        if a.kind == "forward" and s > 0:
            y = where[("forward", i, s - 1)]
            after((d, a), y, y[0] != d)
        if _bwd_kinds(a.kind):
            after((d, a), where[("forward", i, s)], False)
            if s < S - 1:
                y = where[("bwd", i, s + 1)]
                after((d, a), y, y[0] != d)
        if a.kind == "backward_weight":
            after((d, a), (d, Action("backward_input", i, a.chunk)), False)

    peaks = []
    for d in range(p):
        held = peak = 0
        for t in range(max(t for t, _ in table) + 1):
            a = table.get((t, d))
            if a is not None and first[(d, a)] == t:
                if a.kind == "forward":
                    held += 1
                    peak = max(peak, held)
                    held -= forward_only
                elif _bwd_kinds(a.kind):
                    held -= 1
        peaks.append(peak)
    return peaks


def unit_ticks(a, d):
    return 2 if a.kind == "backward" else 1


# ---- bubble formulas ----

@FAST
@given(name=st.sampled_from(["gpipe", "1f1b"]), p=ps, m=ms, fb=st.sampled_from([UNIT_FB, UNIT]))
def test_bubble_gpipe_1f1b_is_exact(name, p, m, fb):
    """(p-1)/(m+p-1) exactly, with F = B = 1 and with F = 1, B = 2 (any F, B equal across
    stages keep it exact)."""
    r = simulate(build_schedule(name, p, m), fb)
    assert r.bubble == Fr(p - 1, m + p - 1)
    per = 2 if fb is UNIT_FB else 3
    assert r.makespan == per * (m + p - 1)
    assert r.busy == (per * m,) * p


@FAST
@given(p=ps, k=st.integers(1, 32), v=st.integers(1, 4), b=st.sampled_from([1, 2]))
def test_bubble_interleaved_is_exact(p, k, v, b):
    """(p-1)/(v*m+p-1) with each chunk costing 1/v of a stage (F = 1/v, B = b/v)."""
    m = p * max(1, k // p)
    r = simulate(build_schedule("interleaved", p, m, v), {"forward": Fr(1, v), "backward": Fr(b, v)})
    assert r.bubble == Fr(p - 1, v * m + p - 1)
    assert r.tick == Fr(1, v)


def test_interleaved_beats_1f1b_bubble():
    one = simulate(build_schedule("1f1b", 4, 8))
    two = simulate(build_schedule("interleaved", 4, 8, 2), {"forward": Fr(1, 2), "backward": 1})
    assert two.bubble < one.bubble
    assert two.makespan < one.makespan


# ---- activations in flight ----

@FAST
@given(p=ps, m=ms)
def test_in_flight_1f1b_and_gpipe(p, m):
    one = simulate(build_schedule("1f1b", p, m))
    assert all(one.peak_in_flight[s] <= p - s for s in range(p))
    assert one.peak_in_flight == tuple(min(p - s, m) for s in range(p))
    gp = simulate(build_schedule("gpipe", p, m))
    assert gp.peak_in_flight == (m,) * p


@FAST
@given(p=ps, k=st.integers(1, 8), v=st.integers(2, 4))
def test_in_flight_interleaved(p, k, v):
    """Megatron's warm-up: stage d holds at most 2(p-d-1) + (v-1)p + 1 chunk activations."""
    m = p * k
    r = simulate(build_schedule("interleaved", p, m, v))
    assert r.peak_in_flight == tuple(min(2 * (p - d - 1) + (v - 1) * p + 1, m * v) for d in range(p))


# ---- zero bubble ----

@FAST
@given(p=ps, m=ms)
def test_zero_bubble_is_a_third_of_1f1b(p, m):
    """Conventions: ZB-H1 at F = I = W = 1 against 1F1B at F = 1, B = 2 (the same work).
    For m >= p ZB-H1 idles (p-1) per stage against 1F1B's 3(p-1): a third of the idle
    time (and of the idle/busy ratio, the ZB paper's bubble); as a fraction of the step,
    (p-1)/(3m+p-1) against (p-1)/(m+p-1). Activations in flight equal 1F1B's."""
    zb = simulate(build_schedule("zero_bubble", p, m))
    one = simulate(build_schedule("1f1b", p, m))
    assert sum(zb.busy) == sum(one.busy)
    assert zb.peak_in_flight == one.peak_in_flight
    assert zb.idle_time <= one.idle_time           # for every m
    if m >= p:
        assert 3 * zb.idle_time <= one.idle_time
        assert 3 * zb.bubble_ratio <= one.bubble_ratio
        assert zb.makespan == 3 * m + p - 1
        assert zb.bubble == Fr(p - 1, 3 * m + p - 1)
    assert zb.peak_pending_weight == tuple(min(d + 1, m) for d in range(p))


# ---- deadlock, dependencies, completeness ----

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=valid_configs(), fb=st.sampled_from([UNIT_FB, UNIT]), lat=st.integers(0, 2))
def test_every_valid_schedule_runs_and_respects_dependencies(cfg, fb, lat):
    name, p, m, v = cfg
    sched = build_schedule(name, p, m, v)
    ticks = {"forward": 1, "backward": 1 if fb is UNIT_FB else 2, "backward_input": 1, "backward_weight": 1}
    r = simulate(sched, ticks, latency=lat)                   # raises on deadlock
    assert r.tick == 1
    peaks = check_tick_table(r.tick_table, p, m, v, sched.orders, lambda a, d: ticks[a.kind], lat_ticks=lat)
    assert tuple(peaks) == r.peak_in_flight
    assert len(r.tick_table) == sum(ticks[a.kind] for o in sched.orders for a in o)   # no overlap


@FAST
@given(cfg=valid_configs(), data=st.data())
def test_dependencies_hold_with_uneven_stage_durations(cfg, data):
    """Per-model-stage integer durations (what the cut search feeds in) and per-boundary
    latencies: still no deadlock, every dependency and order respected."""
    name, p, m, v = cfg
    S = p * v
    ints = st.lists(st.integers(1, 4), min_size=S, max_size=S)
    f, i, w = data.draw(ints), data.draw(ints), data.draw(ints)
    lat = data.draw(st.lists(st.integers(0, 3), min_size=S - 1, max_size=S - 1))
    durations = {"forward": f, "backward_input": i, "backward_weight": w}     # B = I + W
    sched = build_schedule(name, p, m, v)
    r = simulate(sched, durations, latency=lat)
    table = {"forward": f, "backward_input": i, "backward_weight": w,
             "backward": [x + y for x, y in zip(i, w)]}

    def time_of(a, d):
        return table[a.kind][a.chunk * p + d]
    # the checker counts ticks (r.tick divides every duration and latency); its hop gap is
    # one number, so it checks the smallest latency, and the exact gaps are checked below
    check_tick_table(r.tick_table, p, m, v, sched.orders, lambda a, d: int(time_of(a, d) / r.tick),
                     lat_ticks=int(min(lat, default=0) / r.tick))
    for e in r.events:
        s = e.action.chunk * p + e.stage
        if e.action.kind == "forward" and s > 0 and (s - 1) % p != e.stage:
            _, prev_end = r.span((s - 1) % p, Action("forward", e.action.microbatch, (s - 1) // p))
            assert e.start >= prev_end + lat[s - 1]
    assert r.busy == tuple(sum(time_of(a, d) for a in sched.orders[d]) for d in range(p))


@pytest.mark.slow
def test_no_deadlock_for_every_valid_schedule():
    """Exhaustive over p in 1..8, m in 1..32, v in 1..4 (unit costs)."""
    for p in range(1, 9):
        for m in range(1, 33):
            for name in ("gpipe", "1f1b", "zero_bubble"):
                simulate(build_schedule(name, p, m))
            if m % p == 0:
                for v in range(1, 5):
                    simulate(build_schedule("interleaved", p, m, v))


def test_hand_made_bad_order_names_the_stuck_actions():
    F, B = (lambda i: Action("forward", i)), (lambda i: Action("backward", i))
    bad = from_orders([[F(0), B(0), F(1), B(1)],
                       [F(1), F(0), B(0), B(1)]], m=2)
    with pytest.raises(DeadlockError) as e:
        simulate(bad)
    msg = str(e.value)
    assert "stage 0 waits at B0 for B0 on stage 1" in msg
    assert "stage 1 waits at F1 for F1 on stage 0" in msg
    assert "after 1 of 8 actions" in msg
    assert e.value.stuck == [(0, B(0), [(1, B(0))]), (1, F(1), [(0, F(1))])]
    assert isinstance(e.value, ValueError)


def test_order_that_waits_on_itself_deadlocks():
    bad = from_orders([[Action("backward", 0), Action("forward", 0)]], m=1)
    with pytest.raises(DeadlockError, match="stage 0 waits at B0 for F0 on stage 0"):
        simulate(bad)


def test_interleaved_wrap_around_is_a_dependency():
    """Model stage p (stage 0, chunk 1) waits for model stage p-1 (stage p-1, chunk 0)."""
    r = simulate(build_schedule("interleaved", 2, 2, 2), {"forward": 1, "backward": 1}, latency=3)
    start_wrap, _ = r.span(0, Action("forward", 0, 1))
    _, end_last = r.span(1, Action("forward", 0, 0))
    assert start_wrap == end_last + 3
    assert build_schedule("interleaved", 4, 4, 2).neighbours() == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert build_schedule("1f1b", 4, 4).neighbours() == ((0, 1), (1, 2), (2, 3))


def test_one_stage_chunks_exchange_nothing():
    """p = 1 with v chunks: every hop stays on the stage, so the latency never applies."""
    r = simulate(build_schedule("interleaved", 1, 3, 4), latency=5)
    assert r.makespan == 3 * 4 * 3 and r.bubble == 0


def test_from_orders_checks_completeness():
    F, B = (lambda i: Action("forward", i)), (lambda i: Action("backward", i))
    with pytest.raises(ShardingError, match="never runs F1"):
        from_orders([[F(0), B(0), B(1)]], m=2)
    with pytest.raises(ShardingError, match="runs F0 twice"):
        from_orders([[F(0), F(0), B(0)]], m=1)
    with pytest.raises(ShardingError, match="exactly one backward"):
        from_orders([[F(0), B(0), Action("backward_weight", 0)]], m=1)
    with pytest.raises(ShardingError, match="out of range"):
        from_orders([[F(0), B(0), F(2)]], m=1)
    with pytest.raises(ValueError, match="kind"):
        Action("sideways", 0)


# ---- invalid inputs ----

def test_invalid_inputs_are_clear():
    with pytest.raises(ShardingError, match=r"m=6 is not a multiple of p=4; use m=4 or 8"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ShardingError, match=r"m=3 is not a multiple of p=4; use m=4"):
        build_schedule("interleaved", 4, 3, 2)
    with pytest.raises(ShardingError, match="virtual_stages=2; use schedule='interleaved'"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ShardingError, match="p \\(stages\\) must be a positive int, got 0"):
        build_schedule("gpipe", 0, 8)
    with pytest.raises(ShardingError, match="unknown pipeline schedule 'zbv'"):
        build_schedule("zbv", 4, 8)
    with pytest.raises(ShardingError, match="latency has 2 entries, expected 3"):
        simulate(build_schedule("1f1b", 4, 4), latency=[1, 2])
    with pytest.raises(ShardingError, match=">= 0"):
        simulate(build_schedule("1f1b", 2, 2), {"forward": -1})


@FAST
@given(name=st.sampled_from(["gpipe", "1f1b", "zero_bubble"]), p=ps, m=st.integers(1, 7))
def test_fewer_micro_batches_than_stages_is_correct(name, p, m):
    """m < p is valid (not an error) for gpipe, 1f1b and zero_bubble: it runs, respects
    every dependency, and for gpipe/1f1b keeps the formula."""
    sched = build_schedule(name, p, m)
    r = simulate(sched)
    check_tick_table(r.tick_table, p, m, 1, sched.orders, unit_ticks)
    if name != "zero_bubble":
        assert r.bubble == Fr(p - 1, m + p - 1)


# ---- tick table, durations, latency, forward-only ----

def test_gpipe_tick_table_by_hand():
    r = simulate(build_schedule("gpipe", 2, 2), UNIT_FB)
    F, B = (lambda i: Action("forward", i)), (lambda i: Action("backward", i))
    assert r.table() == [(F(0), None), (F(1), F(0)), (None, F(1)), (None, B(0)), (B(0), B(1)), (B(1), None)]
    assert r.render() == ("stage 0: F0 F1  .  . B0 B1\n"
                          "stage 1:  . F0 F1 B0 B1  .")
    assert r.tick_table[(4, 0)] == B(0) and (2, 0) not in r.tick_table
    assert r.at(4, 0) == B(0) and r.at(2, 0) is None and r.ticks == 6


def test_zero_bubble_render_p4_m8():
    r = simulate(build_schedule("zero_bubble", 4, 8))
    rows = r.render().splitlines()
    assert rows[0].split()[2:11] == ["F0", "F1", "F2", "F3", ".", ".", ".", "I0", "W0"]
    assert rows[3].split()[-3:] == ["W0", "W1", "W2"]          # the last stage's deferred W's fill the tail


@FAST
@given(p=ps, m=ms, lat=st.integers(0, 3))
def test_gpipe_latency_adds_two_chains(p, m, lat):
    r = simulate(build_schedule("gpipe", p, m), latency=lat)
    assert r.makespan == 3 * (m + p - 1) + 2 * (p - 1) * lat


def test_floats_fractions_and_callables_agree():
    s = build_schedule("zero_bubble", 4, 8)
    exact = simulate(s, {"forward": Fr(1, 2), "backward": 1}, latency=Fr(1, 4))
    floats = simulate(s, {"forward": 0.5, "backward": 1.0}, latency=0.25)
    called = simulate(s, lambda kind, stage: {"forward": 0.5, "backward": 1.0}.get(kind, 0.5), latency=0.25)
    assert float(exact.makespan) == floats.makespan == called.makespan
    import numpy as np   # a dependency of the package: never a reason to skip
    as_numpy = simulate(s, {"forward": np.float32(0.5), "backward": np.float64(1.0)}, latency=np.float64(0.25))
    assert as_numpy.makespan == floats.makespan
    ints = simulate(s, {"forward": np.int64(1), "backward": 2}, latency=np.int32(1))
    assert ints.makespan == simulate(s, {"forward": 1, "backward": 2}, latency=1).makespan
    assert isinstance(ints.makespan, Fr)
    assert exact.tick == Fr(1, 4) and len(exact.table()) == exact.makespan * 4


def test_per_stage_durations_slowest_stage_paces_gpipe():
    """GPipe with stage times t: forward and backward are flow shops, each
    sum(t) + (m-1) * max(t)."""
    f = [1, 3, 2, 1]
    r = simulate(build_schedule("gpipe", 4, 5), {"forward": f, "backward": [2 * x for x in f]})
    assert r.makespan == (sum(f) + 4 * max(f)) * 3
    assert r.busy == tuple(5 * 3 * x for x in f)


def test_forward_only():
    s = build_schedule("1f1b", 4, 6, forward_only=True)
    assert s.forward_only and all(len(o) == 6 for o in s.orders)
    r = simulate(s)
    assert r.makespan == 6 + 4 - 1 and r.peak_in_flight == (1, 1, 1, 1)
    check_tick_table(r.tick_table, 4, 6, 1, s.orders, unit_ticks, forward_only=True)


# ---- ranks sharing a host's cores (forced CPU devices) ----

def _shared_ticks(r):
    return lambda a, d: int((r.span(d, a)[1] - r.span(d, a)[0]) / r.tick)


def check_shared(r, cores, length):
    """From the events alone: between any two event times the running stages each
    progress at min(1, cores / running), and that progress over an action's span is its
    duration (``length(stage, action)``). Returns the idle core-time (cores unused)."""
    times = sorted({t for e in r.events for t in (e.start, e.end)})
    idle, done = Fr(0), {}
    for t0, t1 in zip(times, times[1:]):
        on = [e for e in r.events if e.start <= t0 < e.end]
        rate = min(Fr(1), Fr(cores) / len(on)) if on else Fr(1)
        idle += max(Fr(0), cores - len(on) * rate) * (t1 - t0)
        for e in on:
            done[(e.stage, e.action)] = done.get((e.stage, e.action), 0) + rate * (t1 - t0)
    for e in r.events:
        assert done.get((e.stage, e.action), 0) == length(e.stage, e.action), e
    return idle


def test_shared_cores_gpipe_by_hand():
    """4 ranks on 2 cores, forward only, m = 3: three stages run at 2/3 from t = 2 to 5."""
    s = build_schedule("gpipe", 4, 3, forward_only=True)
    r = simulate(s, cores=2)
    assert r.makespan == 7 and simulate(s).makespan == 6
    assert r.span(2, Action("forward", 0)) == (2, Fr(7, 2)) and r.span(3, Action("forward", 0)) == (Fr(7, 2), 5)
    assert r.work == (3, 3, 3, 3) and r.tick == Fr(1, 2) and r.cores == 2
    # total work 12 over 2 cores, plus the core idle while only the first and the last stage run
    assert r.makespan * 2 == sum(r.work) + check_shared(r, 2, lambda d, a: 1) == 12 + 2


@st.composite
def small_configs(draw):
    """(name, p, m, v) over p in 2..6, m in 1..8: the checker below is quadratic in events."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble"]))
    p = draw(st.integers(2, 6))
    v = draw(st.integers(1, 2)) if name == "interleaved" else 1
    m = p * draw(st.integers(1, 2)) if name == "interleaved" else draw(st.integers(1, 8))
    return name, p, m, v


@FAST
@given(cfg=small_configs(), fb=st.sampled_from([UNIT_FB, UNIT]), data=st.data())
def test_shared_cores_accounting(cfg, fb, data):
    """4 ranks or any other count on fewer cores: every action gets exactly its work at
    the shared rate, dependencies hold, and makespan x cores = total work + idle
    core-time (so the makespan is total work / cores while the cores are all busy)."""
    name, p, m, v = cfg
    s = build_schedule(name, p, m, v)
    side = simulate(s, fb)
    for cores in (data.draw(st.integers(1, p - 1)), Fr(p, 3)):
        if cores >= p:
            continue
        r = simulate(s, fb, cores=cores)
        idle = check_shared(r, cores, lambda d, a: side.span(d, a)[1] - side.span(d, a)[0])
        assert r.makespan * cores == sum(r.work) + idle
        assert r.work == side.busy and r.makespan >= max(side.makespan, Fr(sum(r.work), cores))
        check_tick_table(r.tick_table, p, m, v, s.orders, _shared_ticks(r))
    # one core: the ranks take turns, and some rank always has work
    assert simulate(s, fb, cores=1).makespan == sum(side.busy)


@FAST
@given(cfg=valid_configs(), extra=st.integers(0, 3))
def test_shared_cores_at_least_ranks_is_side_by_side(cfg, extra):
    """cores >= ranks: the critical path, every event as side by side (the unit-cost
    bubble formulas are unchanged)."""
    name, p, m, v = cfg
    s = build_schedule(name, p, m, v)
    side, many = simulate(s), simulate(s, cores=p + extra)
    assert many.events == side.events and many.makespan == side.makespan and many.bubble == side.bubble
    assert many.cores is None


def test_shared_time_and_bad_cores():
    from shardprop.passes.pipeline.simulate import shared_time
    assert shared_time([1, 2, 3], 2) == Fr(7, 2)      # 3 at 2/3 until 1 is done, then 2 alone, then 1
    assert shared_time([1, 2, 3], 3) == 3 and shared_time([1, 2, 3]) == 3 and shared_time([0, 0], 1) == 0
    assert shared_time([1, 1, 1, 1], 2) == 2 == shared_time([1.0, 1.0, 1.0, 1.0], 2.0)
    for bad in (0, -1, True, float("inf"), "2"):
        with pytest.raises(ShardingError, match="cores"):
            simulate(build_schedule("gpipe", 2, 2), cores=bad)


def test_contention_and_shared_cores_of_a_host():
    """The pipeline model's two host figures (compiler/pipeline_step.py): a CPU profile's
    rates over the contention its calibration ran under, and the rank-sized cores that
    forced CPU devices share."""
    from types import SimpleNamespace as NS

    import numpy as np

    from shardprop.compiler.calibrate import host_cores
    from shardprop.compiler.pipeline_step import calibration_contention, shared_cores
    from shardprop.passes.cost import DEFAULT_COST, CostModel
    cores = host_cores()
    assert calibration_contention(CostModel.builtin("cpu")) == max(1.0, 8 / cores)
    assert calibration_contention(DEFAULT_COST) == 1.0                     # no devices measured together
    assert calibration_contention(NS(device_count=8, device_kind="cpu:cpu", host_cores=2)) == 4.0
    assert calibration_contention(NS(device_count=8, device_kind="gpu:h100")) == 1.0
    mesh = lambda n, platform="cpu": NS(devices=np.array([NS(platform=platform)] * n, dtype=object))
    assert shared_cores(mesh(2 * cores), 2 * cores) == cores               # one device per rank
    assert shared_cores(mesh(4 * cores), 2 * cores) == Fr(cores, 2)        # two devices per rank: half a core each
    assert shared_cores(mesh(cores), cores) is None                        # a core per device: side by side
    assert shared_cores(mesh(2 * cores, "gpu"), 2 * cores) is None
    assert shared_cores(NS(), 4) is None                                   # an abstract mesh
