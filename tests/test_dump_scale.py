"""Dumps at scale (issue 28, milestone 4): the per-rank programs as rank classes that
expand to exactly the per-rank text; a 1,024-rank dump prints a handful of programs, not
one per rank (its time, ≤ 2 s, is printed by ``bench/plan_scale.py --dump``)."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import shardprop as sp
from shardprop.ir.printer import print_graph
from shardprop.runtime.dump import expand, expand_rank, rank_classes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))


def _per_rank(graph):
    return [print_graph(graph, rank=r, title=f"program executed by rank {r}") for r in range(graph.mesh.size)]


def _moves(x, y):   # a split moved from one axis to another (a permute), a whole value split (a slice)
    return x * 2.0, y + 1.0


@pytest.mark.parametrize("case", ["seed", "transformer", "moves", "mlp2x4"])
def test_classes_expand_to_exactly_the_per_rank_text(case):
    import golden_nets as g
    if case == "seed":
        plan = sp.parallelize(g.seed_net, mesh=8).plan(*g.seed_args())
    elif case == "transformer":
        plan = sp.parallelize(g.transformer_layer, mesh=8).plan(*g.transformer_args())
    elif case == "moves":
        plan = sp.parallelize(_moves, mesh=((2, 2, 2), ("a", "b", "c")), in_strategy=(P("a"), P()),
                              out_strategy=(P("b"), P(("a", "c")))).plan(jnp.ones(8), jnp.ones(8))
        assert plan.count("permute") == 1 and plan.count("slice") == 1
    else:
        def mlp(x, w1, w2):
            return jnp.sum(jax.nn.relu(sp.shard(jnp.matmul, (P("dp", None), P(None, "mp")))(x, w1)) @ w2)
        plan = sp.parallelize(mlp, mesh=((2, 4), ("dp", "mp"))).plan(jnp.ones((8, 16)), jnp.ones((16, 32)),
                                                                      jnp.ones((32, 16)))
    classes = rank_classes(plan.graph, check=())      # no rank checked: the template alone
    assert len(classes["templates"]) == 1 and set(classes["index"]) == {0}
    assert [expand(classes, r) for r in range(8)] == _per_rank(plan.graph)


def test_small_meshes_dump_one_file_per_rank_as_before(tmp_path):
    import golden_nets as g
    plan = sp.parallelize(g.seed_net, mesh=8).plan(*g.seed_args())
    plan.dump(str(tmp_path / "all"))
    assert sorted(p.name for p in (tmp_path / "all").iterdir() if p.name.startswith("rank")) == \
        [f"rank_{r}" for r in range(8)]
    plan.dump(str(tmp_path / "two"), dump_ranks=[1, 6])
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.name.startswith("rank")) == ["rank_1", "rank_6"]
    assert (tmp_path / "two" / "rank_6" / "execute.ir").read_text() == \
        (tmp_path / "all" / "rank_6" / "execute.ir").read_text()


@pytest.mark.slow
def test_1024_rank_dump_prints_classes_not_ranks(tmp_path, monkeypatch):
    from plan_scale import gpt_step

    import shardprop.runtime.dump as dump
    step, args = gpt_step(2)
    plan = sp.parallelize(step, mesh=AbstractMesh((16, 64), ("dp", "mp")), progress=False).plan(*args)
    printed = []
    monkeypatch.setattr(dump, "print_graph", lambda graph, rank, **kw: printed.append(rank) or print_graph(graph, rank, **kw))
    plan.dump(str(tmp_path), dump_ranks=[0, 777])
    monkeypatch.undo()
    # a rank's program is printed whole only to find and check the classes: a few ranks, not 1,024
    assert len(printed) <= 8, printed
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) < 40
    index = (tmp_path / "rank_classes" / "index.txt").read_text()
    assert "class 0: ranks 0-1023" in index
    for r in (0, 1, 63, 64, 777, 1023):
        assert expand_rank(str(tmp_path), r) == print_graph(plan.graph, rank=r,
                                                            title=f"program executed by rank {r}")
    assert (tmp_path / "rank_777" / "execute.ir").read_text() == expand_rank(str(tmp_path), 777)
