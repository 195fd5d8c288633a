"""The pipeline configuration search (passes/pipeline/search.py, issue 26): against brute
force over every configuration and every cut for small models, better than equal-layer
cuts on unequal layers, under the memory limit, every rejection with its reason."""
import itertools
import math
import random

import pytest

from shardprop.ir.errors import ShardingError
from shardprop.ir.mesh import Mesh
from shardprop.passes.cost import CostModel, wire_bytes
from shardprop.passes.pipeline.cuts import brute_force_cuts
from shardprop.passes.pipeline.search import LayerCosts, equal_layer_candidate, search_pipeline

COST = CostModel(latency_s=2e-6, link_bytes_per_s=50e9)


def random_costs(rng, L, tp=1, rows=1):
    """Unequal layers: each its own forward time, backward about twice it, state and activations;
    tensor parallelism divides the work but adds its collectives (a share per doubling)."""
    fwd = [rng.uniform(0.2, 3.0) * 1e-3 / tp + 0.4e-3 * math.log2(tp) for _ in range(L)]
    return LayerCosts(forward_s=fwd, backward_s=[2 * f * rng.uniform(0.8, 1.2) for f in fwd],
                      state_bytes=[rng.uniform(1, 4) * 1e8 / tp for _ in range(L)],
                      activation_bytes=[rng.uniform(1, 3) * 1e7 for _ in range(L)],
                      exchange_bytes=[rng.uniform(1, 8) * 1e6 for _ in range(L - 1)],
                      grad_bytes=[rng.uniform(0.3, 1) * 1e8 / tp for _ in range(L)],
                      update_s=[1e-5] * L, rows=rows)


def reference_step(costs, p, d, t, m, schedule, v, batch, memory_limit=None):
    """Every cut simulated (brute_force_cuts), plus the slowest rank's gradient all-reduce
    and update written out with plain loops; None when nothing fits."""
    mesh = Mesh(("pp", "dp", "mp"), (p, d, t))
    fwd, bwd, act, ex = costs.at_rows(batch // (d * m))
    boundary = [COST.collective_time(x, "permute", ("pp",), mesh) if p > 1 else 0.0 for x in ex]
    total = [f + b for f, b in zip(fwd, bwd)]
    try:
        cuts = brute_force_cuts(total, p, m, schedule, v, boundary_time=boundary, param_bytes=costs.state_bytes,
                                activation_bytes=act, memory_limit=memory_limit,
                                forward_fraction=sum(fwd) / sum(total))
    except ShardingError:
        return None
    sync = 0.0
    for rank in range(p):
        grads = upd = 0.0
        for k, (a, b) in enumerate(cuts.bounds):
            if k % p == rank:
                grads += sum(costs.grad_bytes[a:b])
                upd += sum(costs.update_s[a:b])
        ar = COST.collective_time(wire_bytes("all_reduce", grads, d), "all_reduce", ("dp",), mesh) if d > 1 else 0
        sync = max(sync, ar + upd)
    return cuts.simulated_time + sync


@pytest.mark.parametrize("seed", range(6))
def test_within_5_percent_of_brute_force_over_everything(seed):
    """<= 12 layers of random unequal costs on 8 devices: the search's best is within 5% of
    the best over every pp x dp x tp x m x schedule and every cut, each simulated."""
    rng = random.Random(seed)
    L, devices, batch = rng.randint(6, 9), 8, 16
    by_tp = {t: random_costs(random.Random(seed * 100 + t), L, t) for t in (1, 2, 4, 8)}
    got = search_pipeline(lambda t: by_tp[t], devices, batch, COST, max_microbatches=8, finalists=12, budget=300)
    best = math.inf
    for t, p in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if devices % (t * p) or p > L:
            continue
        d = devices // (t * p)
        for m in (x for x in range(1, 9) if (batch // d) % x == 0):
            for name in ("gpipe", "1f1b", "zero_bubble"):
                r = reference_step(by_tp[t], p, d, t, m, name, 1, batch)
                best = min(best, r if r is not None else math.inf)
            if p > 1 and m % p == 0 and 2 * p <= L:
                r = reference_step(by_tp[t], p, d, t, m, "interleaved", 2, batch)
                best = min(best, r if r is not None else math.inf)
    assert got.best.step_s <= 1.05 * best
    assert got.best.step_s >= best * (1 - 1e-9)      # nothing beats every cut simulated


@pytest.mark.parametrize("seed", range(4))
def test_cuts_within_5_percent_of_brute_force_for_a_fixed_configuration(seed):
    rng = random.Random(10 + seed)
    L = rng.randint(4, 12)
    costs = random_costs(rng, L)
    p = rng.choice([x for x in (2, 3, 4) if x <= L])
    m = rng.choice([2, 4, 8])
    for name in ("gpipe", "1f1b", "zero_bubble"):
        got = search_pipeline(costs, p, 8, COST, pp=p, tp=1, microbatches=m, schedules=(name,))
        ref = reference_step(costs, p, 1, 1, m, name, 1, 8)
        assert got.best.schedule == name and got.best.mesh == (p, 1, 1)
        assert ref * (1 - 1e-9) <= got.best.step_s <= 1.05 * ref


def test_unequal_layers_cut_at_least_1_3x_faster_than_equal_layers():
    """Six light layers then two heavy ones: equal-layer cuts put both heavy layers on the
    last stage; the search balances them (modeled, the simulator on both)."""
    L = 8
    fwd = [1e-3] * 6 + [6e-3] * 2
    costs = LayerCosts(forward_s=fwd, backward_s=[2 * f for f in fwd], state_bytes=[1e8] * L,
                       activation_bytes=[1e7] * L, exchange_bytes=[1e6] * (L - 1))
    auto = search_pipeline(costs, 4, 16, COST, pp=4, tp=1, microbatches=8, schedules=("1f1b",)).best
    equal = equal_layer_candidate(costs, 4, 16, COST, pp=4, tp=1, microbatches=8, schedule="1f1b")
    assert equal.cuts.bounds == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert equal.step_s >= 1.3 * auto.step_s
    assert sorted(b - a for a, b in auto.cuts.bounds) != [2, 2, 2, 2]


def test_memory_limit_respected_and_each_rejection_says_why():
    rng = random.Random(7)
    L = 8
    costs = random_costs(rng, L)
    free = search_pipeline(costs, 4, 32, COST, pp=4, tp=1, microbatches=16)
    gpipe = next(c for c in free.ranked if c.schedule == "gpipe" and c.simulated)
    onef = next(c for c in free.ranked if c.schedule == "1f1b" and c.simulated and c.microbatches == 16)
    assert gpipe.memory_bytes > onef.memory_bytes          # GPipe keeps all 16 micro-batches in flight
    limit = (gpipe.memory_bytes + onef.memory_bytes) / 2
    got = search_pipeline(costs, 4, 32, COST, pp=4, tp=1, microbatches=16, memory_limit=limit)
    assert got.ranked and all(c.memory_bytes <= limit * (1 + 1e-9) for c in got.ranked)
    assert all(c.schedule != "gpipe" for c in got.ranked)
    assert any(c.schedule == "gpipe" and c.reason.startswith("memory") for c in got.rejected)
    for c in got.ranked:     # the per-device figure is the state plus the in-flight activations of its stage
        fwd, bwd, act, ex = costs.at_rows(32 // 16)
        for k, (a, b) in enumerate(c.cuts.bounds):
            assert math.isclose(c.cuts.memory[k], sum(costs.state_bytes[a:b]) + c.cuts.in_flight[k] *
                                sum(act[a:b]), rel_tol=1e-9)
    with pytest.raises(ShardingError, match="no configuration fits"):
        search_pipeline(costs, 4, 32, COST, pp=4, tp=1, microbatches=16, memory_limit=1e3)


def test_divisibility_and_layer_count_rejections():
    costs = random_costs(random.Random(3), 4)
    got = search_pipeline(costs, 8, 12, COST)
    reasons = [c.reason for c in got.rejected]
    assert any("does not split over dp=8" in r for r in reasons)          # 12 rows over 8 replicas
    assert any("too few layers: 4 layers for pp=8" in r for r in reasons)
    assert any("multiple of pp" in r for r in reasons)
    assert all(c.pp * c.dp * c.tp == 8 for c in got.ranked)
    assert all(12 % (c.dp * c.microbatches) == 0 for c in got.ranked)


def test_a_tp_the_stage_cannot_take_is_rejected_with_its_error():
    costs = random_costs(random.Random(4), 6)

    def by_tp(t):
        if t > 2:
            raise ShardingError(f"heads do not split {t} ways")
        return costs
    got = search_pipeline(by_tp, 8, 16, COST)
    assert all(c.tp <= 2 for c in got.ranked)
    assert any("heads do not split 4 ways" in c.reason for c in got.rejected)
