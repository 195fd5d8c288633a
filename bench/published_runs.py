"""Predicted against published TFLOP/s per GPU (docs/results/published_runs.md).

Each row of a published table is planned with examples/gpt_plan.py's GPT (Megatron's
marks, mixed precision, full recomputation per layer) on an abstract mesh of its size
(pp x dp x mp where the run had pipeline stages: ``sp.plan_step``'s pipeline search
picks the cuts and the micro-batch count, the schedule is 1F1B), priced by
``sp.Cluster`` with the GPU's profile (datasheet figures and published matmul-efficiency
measurements; the run's own published network where it differs), and its modeled step
time turned into TFLOP/s per GPU with the same formula the table used:

    96 B s L h^2 (1 + s / 6h + V / 16 L h)      (Narayanan et al. 2021, eq. 3)

so predicted / published is published step time / predicted step time. Collectives over
groups spanning nodes are priced as the runs' NCCL ran them (one flat ring), and again
as hierarchical collectives (``sp.Cluster``'s default) for the second column.

Each row's step is priced with the kernels its framework launched (``Row.kernels``: Megatron-LM's
fused kernels and every other op on its own for the DLPerf and Megatron-LM rows, XLA's fusion for
PaddleNLP's); ``--kernels NAME`` prices every row with one policy instead ("xla": the table before
the policies; "unfused": nothing fused, the far bound).

    python bench/published_runs.py [--only NAME[,NAME...]] [--no-hierarchical] [--ablate] [--kernels NAME]
                                   [--breakdown]
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
    # every run's GPT: Megatron-LM's defaults (--hidden-dropout 0.1, --attention-dropout 0.1,
    # biased linears) and PaddleNLP's GPT-3 configs (hidden and attention-probs dropout 0.1)
    dropout: float = 0.1
    bias: bool = True
    microbatches: int = 0          # the run's micro-batches per step, where it published them (0: searched)
    # the kernels the run's framework launched (passes/fusion.py: KernelPolicy): Megatron-LM's fused
    # kernels, every other op on its own (passes/profiles/kernels-megatron-2021.json); "xla" where
    # which ops the framework fused was not confirmed from its source
    kernels: str = "megatron-2021"

    @property
    def gpus(self) -> int:
        return self.mp * self.pp * self.dp


# DLPerf (OneFlow, 2021): NVIDIA/Megatron-LM on 4 nodes of 8 V100-SXM2-16GB, InfiniBand 100 Gb/s per node;
# seq 2048, vocab 51200; heads, micro-batch sizes and accumulation steps as DLPerf's Megatron-LM/README.md
# lists each case (no accumulation without pipeline stages; 32 micro-batches per step with them)
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
    Row(name="MP_1x1x1_8_768x12", heads=12, hidden=768, layers=12, mp=1, pp=1, dp=1, batch=8, published=32.63, **_dl),
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
    # 50304 are PaddleNLP's GPT-3 defaults, not in the table; its kernels are priced as XLA fuses (which
    # ops the benchmark's Paddle program fused was not confirmed)
    Row(source="PaddleNLP GPT-3", name="9.66B", heads=16, hidden=4096, layers=48, mp=8, pp=1, dp=1, batch=512,
        published=55.77, gpu="v100-32gb", seq=1024, vocab=50304, kernels="xla"),
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

# rows with pipeline stages, planned by sp.plan_step on a pp x dp x mp mesh (pp outermost, as the runs
# laid ranks out: tensor parallel inside a node); where a run's micro-batch count is published (DLPerf)
# it is used, elsewhere the pipeline search picks it; the schedule is 1F1B, which every one of these runs had
ROWS += [
    Row(name="DP_PP_8x1x4_512_1536x16", heads=16, hidden=1536, layers=16, mp=1, pp=4, dp=8, batch=512,
        published=32.82, microbatches=32, **_dl),
    Row(name="MP_PP_1x8x4_512_2304x24", heads=24, hidden=2304, layers=24, mp=8, pp=4, dp=1, batch=512,
        published=21.80, microbatches=32, **_dl),
    Row(name="2D_PP_2x4x4_512_2304x24", heads=24, hidden=2304, layers=24, mp=4, pp=4, dp=2, batch=512,
        published=31.53, microbatches=32, **_dl),
    Row(name="2D_PP_2x8x2_512_2304x24", heads=24, hidden=2304, layers=24, mp=8, pp=2, dp=2, batch=512,
        published=29.69, microbatches=32, **_dl),
    # PaddleNLP rows 2-4 (the table)
    Row(source="PaddleNLP GPT-3", name="16.31B", heads=16, hidden=6144, layers=36, mp=8, pp=2, dp=2, batch=512,
        published=60.84, gpu="v100-32gb", seq=1024, vocab=50304, kernels="xla"),
    Row(source="PaddleNLP GPT-3", name="91B", heads=32, hidden=8192, layers=112, mp=8, pp=16, dp=1, batch=512,
        published=62.05, gpu="v100-32gb", seq=1024, vocab=50304, kernels="xla"),
    Row(source="PaddleNLP GPT-3", name="146B", heads=32, hidden=11264, layers=96, mp=32, pp=8, dp=2, batch=2048,
        published=60.82, gpu="v100-32gb", seq=1024, vocab=50304, kernels="xla"),
    # Megatron-LM 2021 Table 1, the rows with pipeline stages (DP = GPUs / (TP x PP))
    Row(source="Megatron-LM 2021", name="39.1B", heads=64, hidden=8192, layers=48, mp=8, pp=2, dp=32, batch=1536,
        published=138, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="76.1B", heads=80, hidden=10240, layers=60, mp=8, pp=4, dp=32, batch=1792,
        published=140, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="145.6B", heads=96, hidden=12288, layers=80, mp=8, pp=8, dp=24, batch=2304,
        published=148, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="310.1B", heads=128, hidden=16384, layers=96, mp=8, pp=16, dp=15,
        batch=2160, published=155, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="529.6B", heads=128, hidden=20480, layers=105, mp=8, pp=35, dp=9,
        batch=2520, published=163, gpu="a100-80gb", dtype="bfloat16"),
    Row(source="Megatron-LM 2021", name="1008.0B", heads=160, hidden=25600, layers=128, mp=8, pp=64, dp=6,
        batch=3072, published=163, gpu="a100-80gb", dtype="bfloat16"),
]


def formula_flops(r: Row) -> float:
    """Narayanan et al. 2021, eq. 3: the step's flops with full recomputation."""
    h, s, L, V, B = r.hidden, r.seq, r.layers, r.vocab, r.batch
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


# --ablate: each mechanism the model added on 2026-11-27, taken out one at a time
ABLATIONS = {
    "HBM at the datasheet's peak": dict(gpu=dict(memory_achieved_bytes_per_s=0.0)),
    "NVLink at its peak": dict(gpu=dict(nvlink_efficiency=1.0)),
    "NVLink switched (no cube mesh)": dict(gpu=dict(nvlink_links=())),
    "no dropout": dict(row=dict(dropout=0.0)),
    "no biases": dict(row=dict(bias=False)),
}


def cluster_for(r: Row, collectives: str, gpu_changes: dict = None, kernels: str = None) -> sp.Cluster:
    """The row's cluster, its steps priced with ``kernels`` (default: the row's framework's)."""
    gpu = GpuProfile.builtin(r.gpu)
    if gpu_changes:
        gpu = dataclasses.replace(gpu, **gpu_changes)
    if r.nic_bytes_per_s:
        gpu = dataclasses.replace(gpu, nic_bytes_per_s=r.nic_bytes_per_s)
    if r.memory_bytes:
        gpu = dataclasses.replace(gpu, memory_capacity_bytes=r.memory_bytes)
    nodes = max(1, -(-r.gpus // r.gpus_per_node))
    return sp.Cluster(nodes, min(r.gpus_per_node, r.gpus), gpu, collectives, kernels=kernels or r.kernels)


def row_step(r: Row):
    """The row's training step as the runs trained it (examples/gpt_plan.py's GPT: the row's
    sizes and dtype, full recomputation, its dropout and biases) and its arguments."""
    import gpt_plan
    cfg = gpt_plan.GPT(layers=r.layers, hidden=r.hidden, heads=r.heads, seq=r.seq, vocab=r.vocab, batch=r.batch,
                       compute_dtype=r.dtype, remat=True, dropout=r.dropout, bias=r.bias)
    return gpt_plan.train_step_and_args(cfg)


def predict(r: Row, hierarchical: bool = True, gpu_changes: dict = None, kernels: str = None) -> dict:
    """The row planned and priced twice: with collectives over groups spanning nodes run
    as NCCL runs them (one flat ring: what these PyTorch / Paddle runs' NCCL did; the
    headline) and as hierarchical collectives (``sp.Cluster``'s default), with the row's kernel
    policy (``kernels``: another for every row)."""
    step, args = row_step(r)
    if r.pp > 1:
        mesh = AbstractMesh((r.pp, r.dp, r.mp), ("pp", "dp", "mp"))
        # the run's micro-batch count, else any count that divides a replica's batch (the search's
        # default stops at 64)
        kw = (dict(pipeline=sp.Pipeline(microbatches=r.microbatches, schedule="1f1b")) if r.microbatches else
              dict(pipeline=sp.Pipeline(microbatches="auto", schedule="1f1b"),
                   search_options=dict(max_microbatches=r.batch // r.dp)))
    else:
        mesh, kw = AbstractMesh((r.dp, r.mp), ("dp", "mp")), {}
    flops = formula_flops(r)
    t0 = time.perf_counter()
    # planned and priced with the run's kernels (the cluster's)
    est = sp.plan_step(step, args, mesh=mesh, cost_model=cluster_for(r, "ring", gpu_changes, kernels),
                       tokens=r.batch * r.seq, **kw)
    planning_s = time.perf_counter() - t0
    hier = (sp.plan_step(step, args, mesh=mesh, cost_model=cluster_for(r, "hierarchical", gpu_changes, kernels),
                         tokens=r.batch * r.seq, **kw) if hierarchical else None)
    return dict(row=r, est=est, planning_s=planning_s, predicted=flops / r.gpus / est.step_s / 1e12,
                hierarchical=flops / r.gpus / hier.step_s / 1e12 if hier else float("nan"),
                graph_vs_formula=est.flops / flops)


def table(results) -> str:
    lines = ["| source | row | heads | hidden | layers | MP | PP | DP | GPUs | batch | published | predicted | "
             "pred/pub | in band | comm share | pipeline | hierarchical: pred/pub | graph flops / formula |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in results:
        r, est = x["row"], x["est"]
        ratio = x["predicted"] / r.published
        pipe = est.extra.get("pipeline")
        # a pipelined step's communication is inside its stages' times: show the schedule instead
        comm = "" if pipe else f"{est.communication_s / est.step_s:.0%}"
        sched = (f"{pipe['microbatches']} x {pipe['rows_per_microbatch']} rows, bubble {pipe['bubble']:.0%}"
                 + ("" if pipe["fits"] else ", does not fit")) if pipe else ""
        lines.append(f"| {r.source} | {r.name} | {r.heads} | {r.hidden} | {r.layers} | {r.mp} | {r.pp} | {r.dp} | "
                     f"{r.gpus} | {r.batch} | {r.published:.2f} | {x['predicted']:.2f} | {ratio:.2f} | "
                     f"{'yes' if 0.8 <= ratio <= 1.2 else 'no'} | {comm} | {sched} | "
                     f"{x['hierarchical'] / r.published:.2f} | {x['graph_vs_formula']:.2f} |")
    return "\n".join(lines)


def ablate(rows, kernels=None) -> int:
    """pred/pub per row with everything, then with each of ``ABLATIONS`` taken out."""
    print("| row | all | " + " | ".join(ABLATIONS) + " |")
    print("|---|---|" + "---|" * len(ABLATIONS))
    for r in rows:
        cells = [predict(r, hierarchical=False, kernels=kernels)["predicted"] / r.published]
        for change in ABLATIONS.values():
            row = dataclasses.replace(r, **change.get("row", {}))
            cells.append(predict(row, hierarchical=False, gpu_changes=change.get("gpu"),
                                 kernels=kernels)["predicted"] / r.published)
        print(f"| {r.name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)
    return 0


def breakdown(rows, policies=("xla", None)) -> int:
    """Per row, its modeled step (ring collectives) by kernel, under XLA's fusion and under
    the row's own policy: each op's compute time (``cost.strategy_work`` at the policy's
    resident values) summed by the kernel it belongs to under Megatron-LM's patterns (a
    pattern and its backward together); ops over the vocabulary (the loss) apart."""
    import collections

    from shardprop.ir.graph import is_collective
    from shardprop.passes.cost import compute_unit, is_contraction, strategy_work, tensor_factors
    from shardprop.passes.fusion import builtin_policy, resident_values
    for r in rows:
        step, args = row_step(r)
        for name in policies:
            cluster = cluster_for(r, "ring", kernels=name)
            cost = cluster.cost_model()
            est = sp.plan_step(step, args, mesh=AbstractMesh((r.dp, r.mp), ("dp", "mp")), cost_model=cluster,
                               tokens=r.batch * r.seq)
            graph = est.plan.graph
            resident = resident_values(graph, cost.kernels)
            kernel = {op: k.pattern.replace(" backward", "") or ("matmul" if op.kind == "dot_general" else "other")
                      for k in builtin_policy("megatron-2021").kernels(graph) for op in k.ops}
            ms = collections.Counter()
            for op in graph.ops:
                st = op.strategy
                if st is None or is_collective(op):
                    continue
                work = strategy_work(st.rule.flops, st.factors, tensor_factors(op, st.rule, resident), graph.mesh)
                loss = op.kind != "dot_general" and any(r.vocab in v.type.shape for v in op.inputs + op.outputs)
                ms["loss" if loss else kernel[op]] += 1e3 * cost.compute_time(
                    *work, contraction=is_contraction(st.rule), unit=compute_unit(op))
            print(f"{r.name} [{cost.kernels}] step {est.step_s * 1e3:.1f} ms: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in ms.most_common()), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="the rows whose name contains this (comma-separated: any of them)")
    ap.add_argument("--no-hierarchical", action="store_true",
                    help="plan each row once, with ring collectives (the hierarchical column is left empty)")
    ap.add_argument("--ablate", action="store_true",
                    help="per row, pred/pub with each of the 2026-11-27 mechanisms taken out in turn (ring collectives)")
    ap.add_argument("--kernels", help="price every row with this kernel policy instead of its framework's: "
                                      "xla (XLA's fusion), unfused (every op reads and writes its operands in HBM: "
                                      "the far bound), megatron-2021")
    ap.add_argument("--breakdown", action="store_true",
                    help="per row, the modeled step's compute by kernel (ms), with XLA's fusion and the row's kernels")
    a = ap.parse_args(argv)
    if a.breakdown:
        return breakdown([r for r in ROWS if not a.only or any(o in r.name for o in a.only.split(","))])
    if a.ablate:
        return ablate([r for r in ROWS if not a.only or any(o in r.name for o in a.only.split(","))], a.kernels)
    results = []
    for r in ROWS:
        if a.only and not any(o in r.name for o in a.only.split(",")):
            continue
        x = predict(r, hierarchical=not a.no_hierarchical, kernels=a.kernels)
        results.append(x)
        print(f"{r.source:18} {r.name:24} [{a.kernels or r.kernels}] published {r.published:7.2f} "
              f"predicted {x['predicted']:7.2f} "
              f"({x['predicted'] / r.published:.2f}x; hierarchical {x['hierarchical'] / r.published:.2f}x) "
              f"planned in {x['planning_s']:.1f} s", flush=True)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
