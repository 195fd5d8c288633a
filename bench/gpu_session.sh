#!/bin/bash
# Everything a machine with a GPU (and its host's CPUs) should measure:
#   bash bench/gpu_session.sh OUTDIR              # every step, in the order below
#   bash bench/gpu_session.sh OUTDIR STEP...      # only these (a device call runs at most
#                                                 # 10 minutes: split the steps over two calls)
# On the GPU: the smoke run and the GPU profile check (with the GPT step's parts). On the
# host's CPUs (8 forced devices): a fresh calibration, then the pipeline benches (the
# schedules; automatic against equal cuts) and auto under memory limits priced by it, and
# the zoo against XLA. A step that prices by the calibration runs it first where OUTDIR
# has none. Each step has a time limit and writes OUTDIR/<step>.txt as it goes, so a
# step cut short keeps what it printed.
# docs/results/gpu.md has the first such run (one H200, 2026-11-27).
set -u
out=${1:?usage: bash bench/gpu_session.sh OUTDIR [STEP...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
all="gpu_smoke gpu_profile calibrate pipeline pipeline_cuts compare_limits compare"
steps=${*:-$all}
for s in $steps; do
    case " $all " in *" $s "*) ;; *) echo "unknown step '$s': the steps are: $all" >&2; exit 2 ;; esac
done
step() {   # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "== $name: $*" | tee "$out/$name.txt"
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.txt"
}
calibrated() {   # the host's profile, measured once per OUTDIR
    [ -f "$out/cpu.json" ] || step calibrate 120 $py -m shardprop.compiler.cli calibrate --mesh 8 --cpu --reps 5 \
        -o "$out/cpu.json"
}
{ date -u; git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null; nproc; } | tee "$out/env.txt"
for s in $steps; do
    case $s in
    gpu_smoke) step gpu_smoke 120 $py bench/gpu_smoke.py ;;
    gpu_profile) step gpu_profile 240 $py bench/gpu_profile.py --parts ;;
    calibrate) calibrated ;;
    pipeline) calibrated; step pipeline 150 $py bench/pipeline.py --reps 5 --cost-model "$out/cpu.json" ;;
    # automatic cuts against equal-layer marks, measured where the ranks have cores of their
    # own (issue 26's "measured >= 1.3x": the 2-vCPU development machines run ranks one after another)
    pipeline_cuts) step pipeline_cuts 150 $py bench/pipeline_cuts.py --batch 512 --lowering mpmd \
        --one-thread-per-device --reps 5 --steps 5 ;;
    compare_limits) calibrated; step compare_limits 240 $py bench/compare.py --auto --hand --quick \
        --limits 0.5,0.7,0.9 --cost-model "$out/cpu.json" --cases gpt2_train_dp2xmp4 gpt2_train_mp8 gpt2_train_dp4xmp2 ;;
    compare) step compare 150 $py bench/compare.py --quick ;;
    esac
done
