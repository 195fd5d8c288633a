"""Predicted against published TFLOP/s per GPU (docs/results/published_runs.md).

Each row of a published table (tensor and data parallel only: rows with pipeline
stages wait for pipelines in ``sp.plan_step``) is planned with examples/gpt_plan.py's
GPT (Megatron's marks, mixed precision, full recomputation per layer) on an abstract
mesh of its size, priced by ``sp.Cluster`` with the GPU's profile (datasheet figures
and published matmul-efficiency measurements; the run's own published network where it
differs), and its modeled step time turned into TFLOP/s per GPU with the same formula
the table used:

    96 B s L h^2 (1 + s / 6h + V / 16 L h)      (Narayanan et al. 2021, eq. 3)

so predicted / published is published step time / predicted step time. Collectives over
groups spanning nodes are priced as the runs' NCCL ran them (one flat ring), and again
as hierarchical collectives (``sp.Cluster``'s default) for the second column.

    python bench/published_runs.py [--only NAME]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from jax.sharding import AbstractMesh  # noqa: E402

import shardprop as sp  # noqa: E402
from shardprop.passes.cluster import GpuProfile  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Row:
    source: str
    name: str
    heads: int
    hidden: int
    layers: int
    mp: int
    pp: int
    dp: int
    batch: int
    published: float          # TFLOP/s per GPU
    gpu: str
    seq: int = 2048
    vocab: int = 51200
    gpus_per_node: int = 8
    nic_bytes_per_s: float = 0.0   # the run's own network per GPU, where it published one
    memory_bytes: int = 0          # the run's GPU memory, where it differs from the profile
    dtype: str = "float16"

    @property
    def gpus(self) -> int:
        return self.mp * self.pp * self.dp


# DLPerf (OneFlow, 2021): NVIDIA/Megatron-LM on 4 nodes of 8 V100-SXM2-16GB, InfiniBand 100 Gb/s per node;
# seq 2048, vocab 51200; heads not published (hidden / 96 here)
DLPERF = "DLPerf Megatron-LM"
_dl = dict(source=DLPERF, gpu="v100-32gb", nic_bytes_per_s=100e9 / 8 / 8, memory_bytes=16 * 2 ** 30)
ROWS = [
    Row(name="DP_1x1x1_2_1536x16", heads=16, hidden=1536, layers=16, mp=1, pp=1, dp=1, batch=2, published=43.25, **_dl),
    Row(name="DP_8x1x1_16_1536x16", heads=16, hidden=1536, layers=16, mp=1, pp=1, dp=8, batch=16, published=41.74,
        **_dl),
    Row(name="DP_16x1x1_32_1536x16", heads=16, hidden=1536, layers=16, mp=1, pp=1, dp=16, batch=32, published=30.21,
        **_dl),
    Row(name="DP_32x1x1_64_1536x16", heads=16, hidden=1536, layers=16, mp=1, pp=1, dp=32, batch=64, published=29.37,
        **_dl),
    Row(name="MP_1x1x1_8_768x12", heads=8, hidden=768, layers=12, mp=1, pp=1, dp=1, batch=8, published=32.63, **_dl),
    Row(name="MP_1x8x1_16_1536x16", heads=16, hidden=1536, layers=16, mp=8, pp=1, dp=1, batch=16, published=28.99,
        **_dl),
    Row(name="MP_1x16x1_16_3072x16", heads=32, hidden=3072, layers=16, mp=16, pp=1, dp=1, batch=16, published=6.22,
        **_dl),
    Row(name="MP_1x32x1_16_3072x32", heads=32, hidden=3072, layers=32, mp=32, pp=1, dp=1, batch=16, published=2.60,
        **_dl),
    Row(name="2D_2x4x1_16_1536x16", heads=16, hidden=1536, layers=16, mp=4, pp=1, dp=2, batch=16, published=34.82,
        **_dl),
    Row(name="2D_4x2x1_16_1536x16", heads=16, hidden=1536, layers=16, mp=2, pp=1, dp=4, batch=16, published=33.81,
        **_dl),
    Row(name="2D_2x8x1_16_2304x24", heads=24, hidden=2304, layers=24, mp=8, pp=1, dp=2, batch=16, published=23.00,
        **_dl),
    Row(name="2D_4x8x1_32_2304x24", heads=24, hidden=2304, layers=24, mp=8, pp=1, dp=4, batch=32, published=20.03,
        **_dl),
    # PaddleNLP GPT-3 hybrid parallel benchmark on V100 (2022), row 1 (the table); seq 1024 and vocab
    # 50304 are PaddleNLP's GPT-3 defaults, not in the table
    Row(source="PaddleNLP GPT-3", name="9.66B", heads=16, hidden=4096, layers=48, mp=8, pp=1, dp=1, batch=512,
        published=55.77, gpu="v100-32gb", seq=1024, vocab=50304),
    # Megatron-LM (Narayanan et al. 2021, Table 1) on Selene, DGX A100 80GB, rows without pipeline stages
    Row(source="Megatron-LM 2021", name="1.7B", heads=24, hidden=2304, layers=24, mp=1, pp=1, dp=32, batch=512,
        published=137, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="3.6B", heads=32, hidden=3072, layers=30, mp=2, pp=1, dp=32, batch=512,
        published=138, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="7.5B", heads=32, hidden=4096, layers=36, mp=4, pp=1, dp=32, batch=512,
        published=142, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="18.4B", heads=48, hidden=6144, layers=40, mp=8, pp=1, dp=32, batch=1024,
        published=135, gpu="a100-80gb", dtype="bfloat16"),
]

PENDING = [   # rows that need pipeline stages (PP > 1)
    ("PaddleNLP GPT-3", "16.31B: 16 heads, hidden 6144, 36 layers, MP 8, PP 2, DP 2, 32 GPUs, batch 512", 60.84),
    ("PaddleNLP GPT-3", "91B: 32 heads, hidden 8192, 112 layers, MP 8, PP 16, DP 1, 128 GPUs, batch 512", 62.05),
    ("PaddleNLP GPT-3", "146B: 32 heads, hidden 11264, 96 layers, MP 32, PP 8, DP 2, 512 GPUs, batch 2048", 60.82),
    ("DLPerf Megatron-LM", "DP_PP_8x1x4_512_1536x16, MP_PP_1x8x4_512_2304x24, 2D_PP_2x4x4_512_2304x24, "
                           "2D_PP_2x8x2_512_2304x24", None),
    ("Megatron-LM 2021", "39.1B (PP 2) to 1T (PP 64): Table 1's rows with pipeline stages", None),
]


def formula_flops(r: Row) -> float:
    """Narayanan et al. 2021, eq. 3: the step's flops with full recomputation."""
    h, s, L, V, B = r.hidden, r.seq, r.layers, r.vocab, r.batch
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def cluster_for(r: Row, collectives: str) -> sp.Cluster:
    gpu = GpuProfile.builtin(r.gpu)
    if r.nic_bytes_per_s:
        gpu = dataclasses.replace(gpu, nic_bytes_per_s=r.nic_bytes_per_s)
    if r.memory_bytes:
        gpu = dataclasses.replace(gpu, memory_capacity_bytes=r.memory_bytes)
    nodes = max(1, -(-r.gpus // r.gpus_per_node))
    return sp.Cluster(nodes, min(r.gpus_per_node, r.gpus), gpu, collectives)


def predict(r: Row) -> dict:
    """The row planned and priced twice: with collectives over groups spanning nodes run
    as NCCL runs them (one flat ring: what these PyTorch / Paddle runs' NCCL did; the
    headline) and as hierarchical collectives (``sp.Cluster``'s default)."""
    import gpt_plan
    cfg = gpt_plan.GPT(layers=r.layers, hidden=r.hidden, heads=r.heads, seq=r.seq, vocab=r.vocab, batch=r.batch,
                       compute_dtype=r.dtype, remat=True)
    step, args = gpt_plan.train_step_and_args(cfg)
    mesh = AbstractMesh((r.dp, r.mp), ("dp", "mp"))
    flops = formula_flops(r)
    t0 = time.perf_counter()
    est = sp.plan_step(step, args, mesh=mesh, cost_model=cluster_for(r, "ring"), tokens=r.batch * r.seq)
    planning_s = time.perf_counter() - t0
    hier = sp.plan_step(step, args, mesh=mesh, cost_model=cluster_for(r, "hierarchical"), tokens=r.batch * r.seq)
    return dict(row=r, est=est, planning_s=planning_s, predicted=flops / r.gpus / est.step_s / 1e12,
                hierarchical=flops / r.gpus / hier.step_s / 1e12, graph_vs_formula=est.flops / flops)


def table(results) -> str:
    lines = ["| source | row | heads | hidden | layers | MP | PP | DP | GPUs | batch | published | predicted | "
             "pred/pub | in band | comm share | hierarchical: pred/pub | graph flops / formula |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in results:
        r, est = x["row"], x["est"]
        ratio = x["predicted"] / r.published
        lines.append(f"| {r.source} | {r.name} | {r.heads} | {r.hidden} | {r.layers} | {r.mp} | {r.pp} | {r.dp} | "
                     f"{r.gpus} | {r.batch} | {r.published:.2f} | {x['predicted']:.2f} | {ratio:.2f} | "
                     f"{'yes' if 0.8 <= ratio <= 1.2 else 'no'} | {est.communication_s / est.step_s:.0%} | "
                     f"{x['hierarchical'] / r.published:.2f} | {x['graph_vs_formula']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    a = ap.parse_args(argv)
    results = []
    for r in ROWS:
        if a.only and a.only not in r.name:
            continue
        x = predict(r)
        results.append(x)
        print(f"{r.source:18} {r.name:24} published {r.published:7.2f} predicted {x['predicted']:7.2f} "
              f"({x['predicted'] / r.published:.2f}x; hierarchical {x['hierarchical'] / r.published:.2f}x) "
              f"planned in {x['planning_s']:.1f} s", flush=True)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
