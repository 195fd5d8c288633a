"""Kernel policies (passes/fusion.py): which traced ops one kernel runs, as a framework
launched them; "xla" (the default) prices as before."""
import collections
import dataclasses
import os
import sys

import pytest
from jax.sharding import AbstractMesh

import shardprop as sp
from shardprop.ir.errors import ShardingError
from shardprop.passes import fusion
from shardprop.passes.cost import modeled_step_time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt_plan  # noqa: E402


@pytest.fixture(scope="module")
def gpt_step():
    """One planned GPT layer's training step as Megatron-LM trains it (dropout, biases,
    fp16, recomputation), on 2 x 4 abstract devices; and its cluster's cost model."""
    cfg = gpt_plan.GPT(layers=1, hidden=64, heads=4, seq=16, vocab=128, batch=4, compute_dtype="float16",
                       remat=True, dropout=0.1, bias=True)
    step, args = gpt_plan.train_step_and_args(cfg)
    cluster = sp.Cluster(1, 8, "v100-32gb")
    est = sp.plan_step(step, args, mesh=AbstractMesh((2, 4), ("dp", "mp")), cost_model=cluster)
    return est.plan.graph, cluster.cost_model()


def _kinds(kernel):
    return collections.Counter(op.kind for op in kernel.ops)


@pytest.mark.slow   # plans a GPT step (1-3 s on a loaded 2-core machine)
def test_megatron_kernels_on_a_gpt_layer(gpt_step):
    graph, _ = gpt_step
    kernels = fusion.builtin_policy("megatron-2021").kernels(graph)
    # a partition: every op in exactly one kernel
    assert sorted(id(op) for k in kernels for op in k.ops) == sorted(id(op) for op in graph.ops)
    by = collections.defaultdict(list)
    for k in kernels:
        by[k.pattern].append(k)
    # the layer runs forward twice (recomputation) and its final norm once more
    assert len(by["softmax"]) == 2 and len(by["softmax backward"]) == 1
    assert len(by["layer_norm"]) == 2 * 2 + 1 and len(by["bias_gelu"]) == 2
    # two in the forward, one in the recomputation (its second residual is not needed again)
    assert len(by["bias_dropout_add"]) == 3 and len(by["optimizer"]) == 1
    for k in by["softmax"]:   # scale, causal mask and softmax: one kernel, dropout not in it
        kinds = _kinds(k)
        assert kinds["exp"] == kinds["reduce_max"] == kinds["reduce_sum"] == kinds["select_n"] == 1
        assert kinds["div"] == 2 and "random_bits" not in kinds   # the scale and the normalisation
    for k in by["layer_norm"]:
        kinds = _kinds(k)
        assert kinds["rsqrt"] == 1 and kinds["reduce_sum"] == 2 and "random_bits" not in kinds
        assert "dot_general" not in kinds
    for k in by["bias_gelu"]:
        assert _kinds(k)["tanh"] == 1 and _kinds(k)["add"] >= 1   # the bias add is in it
    for k in by["bias_dropout_add"]:   # bias + dropout + residual add
        kinds = _kinds(k)
        assert kinds["random_bits"] == kinds["select_n"] == 1 and kinds["add"] == 2
    # everything else on its own: the matmuls, the q/k/v bias adds, the loss's softmax
    alone = collections.Counter(k.ops[0].kind for k in by[""])
    assert alone["dot_general"] == sum(op.kind == "dot_general" for op in graph.ops)
    assert alone["add"] >= 3 and alone["exp"] == 1 and alone["log"] == 1


@pytest.mark.slow   # plans a GPT step (1-3 s on a loaded 2-core machine)
def test_values_between_kernels_reach_memory(gpt_step):
    graph, _ = gpt_step
    megatron = fusion.resident_values(graph, "megatron-2021")
    xla = fusion.resident_values(graph, "xla")
    softmax = next(k for k in fusion.builtin_policy("megatron-2021").kernels(graph) if k.pattern == "softmax")
    probs = [op for op in softmax.ops if op.kind == "div"][-1].outputs[0]
    # XLA fuses the probabilities into the dropout that reads them; Megatron's softmax kernel writes them
    assert probs in xla and probs not in megatron
    exp = next(op for op in softmax.ops if op.kind == "exp").outputs[0]
    assert exp in xla and exp in megatron           # inside one kernel under both
    assert fusion.resident_values(graph, "unfused") == frozenset()
    # the recomputed softmax's exp, read by the softmax's backward: the fused kernel's
    # backward recomputes it from the probabilities it saved, so it stays out of memory
    kernels = fusion.builtin_policy("megatron-2021").kernels(graph)
    backward = {op for k in kernels if k.pattern == "softmax backward" for op in k.ops}
    readers = graph.users()
    saved = [op.outputs[0] for k in kernels if k.pattern == "softmax" for op in k.ops
             if op.kind == "exp" and any(u in backward for u in readers[op.outputs[0]])]
    assert len(saved) == 1 and saved[0] in megatron


@pytest.mark.slow   # plans a GPT step (1-3 s on a loaded 2-core machine)
def test_xla_is_the_default_and_prices_as_before(gpt_step):
    graph, cost = gpt_step
    assert cost.kernels == "xla" and fusion.resident_values(graph) == fusion.xla_resident(graph)
    before = modeled_step_time(graph, cost)
    megatron = modeled_step_time(graph, dataclasses.replace(cost, kernels="megatron-2021"))
    unfused = modeled_step_time(graph, dataclasses.replace(cost, kernels="unfused"))
    assert modeled_step_time(graph, cost) == before
    # nothing in memory can only cost more: unfused is the far bound of both
    assert unfused["compute"] >= max(before["compute"], megatron["compute"])
    assert megatron["compute"] != before["compute"] and megatron["communication"] == before["communication"]


@pytest.mark.slow   # plans a GPT step twice
def test_the_clusters_kernels_plan_and_price_the_step():
    """sp.Cluster(kernels=...) is the cost model's policy: plan_step plans and prices with it
    (a fresh plan, the same step), and a profile keeps it through save and load."""
    cfg = gpt_plan.GPT(layers=1, hidden=64, heads=4, seq=16, vocab=128, batch=4, compute_dtype="float16",
                       remat=True, dropout=0.1, bias=True)
    step, args = gpt_plan.train_step_and_args(cfg)
    mesh = AbstractMesh((2, 4), ("dp", "mp"))
    xla = sp.plan_step(step, args, mesh=mesh, cost_model=sp.Cluster(1, 8, "v100-32gb"))
    cluster = sp.Cluster(1, 8, "v100-32gb", kernels="megatron-2021")
    megatron = sp.plan_step(step, args, mesh=mesh, cost_model=cluster)
    assert megatron.step_s > xla.step_s
    # the estimate is the step priced with the cluster's kernels, not with XLA's fusion
    graph, cost = megatron.plan.graph, cluster.cost_model()
    assert megatron.step_s == pytest.approx(modeled_step_time(graph, cost)["total"])
    assert megatron.step_s > modeled_step_time(graph, dataclasses.replace(cost, kernels="xla"))["total"]
    with pytest.raises(ShardingError, match="no kernel policy 'pytorch'"):
        sp.Cluster(1, 8, "v100-32gb", kernels="pytorch")


def test_a_profile_keeps_its_kernels(tmp_path):
    from shardprop.passes.cost import CostModel
    model = dataclasses.replace(CostModel.builtin("h100"), kernels="megatron-2021")
    model.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").kernels == "megatron-2021"
    assert CostModel.builtin("h100").kernels == "xla"


def test_policy_names_and_sources():
    policy = fusion.builtin_policy("megatron-2021")
    assert set(policy.patterns) == set(fusion.PATTERNS)
    assert "fused_softmax.py" in policy.sources["softmax"] and "fused_bias_gelu.py" in policy.sources["bias_gelu"]
    with pytest.raises(ShardingError, match="no kernel policy 'pytorch'.*megatron-2021"):
        fusion.builtin_policy("pytorch")
