"""The ``shardprop`` command: ``shardprop launch ...`` starts a multi-process run;
``shardprop report DUMP_DIR -o plan.html`` draws a dump's plan as one HTML page;
``shardprop calibrate --mesh 8 -o profile.json`` measures this machine's cost model;
``shardprop plan script.py:make_step --mesh 16x64:dp,mp --cluster 128x8:a100-80gb``
plans a step for a cluster that is not here (compiler/planning.py); a ``pp`` axis in
``--mesh`` plans pipeline stages (``--microbatches``, ``--schedule``; searched when not
given, and with ``--auto`` the mesh shape too)."""
from __future__ import annotations

import argparse
import dataclasses
import sys

USAGE = ("usage: shardprop launch [--nproc N | --gpus 0,1,...] [--devices-per-proc K] [--ips h1,h2] "
         "[--port P] [--log-dir log] script.py [args...]\n"
         "       shardprop launch --server-num N --worker-num M [--ps-mode async|sync] script.py [args...]\n"
         "       shardprop report DUMP_DIR [-o plan.html] [--explain OP_OR_LINE]\n"
         "       shardprop calibrate [--mesh 8 | --mesh 2x4] [--cpu] [-o profile.json]\n"
         "       shardprop plan script.py:make_step --mesh 16x64:dp,mp --cluster 128x8:a100-80gb [--auto] "
         "[-o plan.html]\n"
         "       shardprop plan script.py:make_step --mesh 8x8x16:pp,dp,mp --cluster 128x8:a100-80gb "
         "[--microbatches M] [--schedule 1f1b] [--auto]\n\n"
         "shardprop launch --help, shardprop report --help, shardprop calibrate --help, shardprop plan --help   "
         "for details")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "launch":
        from ..runtime.launch import main as launch
        return launch(argv[1:])
    if argv[0] == "report":
        return report(argv[1:])
    if argv[0] == "calibrate":
        from .calibrate import main as calibrate
        return calibrate(argv[1:])
    if argv[0] == "plan":
        return plan(argv[1:])
    print(f"shardprop: unknown command {argv[0]!r}; the commands are 'launch', 'report', 'calibrate' and 'plan'",
          file=sys.stderr)
    return 2


def report(argv) -> int:
    ap = argparse.ArgumentParser(
        prog="shardprop report",
        description="Draw the plan in a dump folder (written by parallelize(..., dump_dir=DIR) or plan.dump(DIR)) "
                    "as one self-contained HTML page: it opens from disk in any browser, no server needed.")
    ap.add_argument("dump_dir", help="the dump folder (it holds plan.json)")
    ap.add_argument("-o", "--output", default="plan.html", help="the page to write (default: plan.html)")
    ap.add_argument("--explain", metavar="WHAT",
                    help="print the panel of an op instead (its number on the page, '#12', or a source line, "
                         "'net.py:7')")
    args = ap.parse_args(argv)
    from ..runtime.plan_data import load_plan_data
    try:
        data = load_plan_data(args.dump_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"shardprop report: {e}", file=sys.stderr)
        return 1
    if args.explain is not None:
        from . import explain
        what = args.explain.lstrip("#")
        try:
            if what.isdigit():
                if int(what) >= len(data["ops"]):
                    raise ValueError(f"the plan has ops #0 to #{len(data['ops']) - 1}, not #{what}")
                print(explain.op_text(data, int(what)))
            else:
                print(explain.source_text(data, args.explain))
        except ValueError as e:
            print(f"shardprop report: {e}", file=sys.stderr)
            return 1
        return 0
    from .report import write_html
    write_html(data, args.output)
    print(f"wrote {args.output}: {len(data['plan_ops'])} operators, {len(data['collectives'])} collectives "
          f"(open it in a browser)")
    return 0


def plan(argv) -> int:
    ap = argparse.ArgumentParser(
        prog="shardprop plan",
        description="Plan a training step for a cluster that need not be here: per device memory (parameters, "
                    "gradients, optimizer state, activations, peak), bytes per link class, modeled step time, "
                    "tokens/s, TFLOP/s and MFU, and the HTML report. SCRIPT.py:FUNCTION names a function that "
                    "returns (step_fn, args) or (step_fn, args, options): args the step's arguments as "
                    "jax.ShapeDtypeStruct pytrees, options a dict of sp.plan_step keywords (tokens per step, "
                    "param_argnums, optimizer_argnums).")
    ap.add_argument("step", metavar="SCRIPT.py:FUNCTION")
    ap.add_argument("--mesh", required=True, help="axis sizes and names, e.g. 16x64:dp,mp")
    ap.add_argument("--cluster", help="NODESxGPUS_PER_NODE:GPU, e.g. 128x8:a100-80gb (GPUs: v100-32gb, "
                                      "a100-80gb, h100-80gb); default: the default cost model")
    ap.add_argument("--kernels", default="xla", help="with --cluster: which ops one kernel runs, as the step's framework "
                                                     "launched them: xla (XLA's fusion, the default), megatron-2021, "
                                                     "unfused")
    ap.add_argument("--auto", action="store_true", help="mode='auto': search every strategy (marks kept); with a pp "
                                                         "axis also the mesh shape (pp x dp x tp over its devices)")
    ap.add_argument("--microbatches", help="with a pp axis: micro-batches per step (default: searched)")
    ap.add_argument("--schedule", help="with a pp axis: gpipe, 1f1b, interleaved, zero_bubble (default: searched)")
    ap.add_argument("--virtual-stages", type=int, default=1, help="with a pp axis: chunks per stage (interleaved)")
    ap.add_argument("-o", "--output", default="plan.html", help="the report to write (default: plan.html)")
    ap.add_argument("--json", help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    from ..ir.errors import ShardingError
    from ..passes.cluster import Cluster
    from .planning import load_step, parse_mesh, plan_step
    try:
        fn, step_args, options = load_step(args.step)
        mesh = parse_mesh(args.mesh)
        cluster = Cluster.parse(args.cluster) if args.cluster else None
        if args.kernels != "xla":
            if cluster is None:
                raise ShardingError(f"--kernels {args.kernels}: give --cluster too (the kernels are the GPUs' "
                                    "cost model's)")
            cluster = dataclasses.replace(cluster, kernels=args.kernels)
        if args.auto:
            options["mode"] = "auto"
        if args.microbatches or args.schedule or args.virtual_stages > 1:
            from .stages import Pipeline
            m = args.microbatches or "auto"
            options["pipeline"] = Pipeline(microbatches=int(m) if str(m).isdigit() else m,
                                           schedule=args.schedule or ("interleaved" if args.virtual_stages > 1
                                                                      else "auto"),
                                           virtual_stages=args.virtual_stages)
        est = plan_step(fn, step_args, mesh=mesh, cost_model=cluster, report=args.output, **options)
    except ShardingError as e:
        print(f"shardprop plan: {e}", file=sys.stderr)
        return 1
    print(est)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(est.as_dict(), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
