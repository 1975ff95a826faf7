#!/usr/bin/env bash
# The one device run for a session that is lent a GPU, from the repository root (bash bench/gpu_run.sh):
#   1. the CUDA tests: the Triton readout kernel compiled (test_readout_triton), the readout's loop
#      sequences on CUDA (test_readout), the pool on CUDA (test_serve);
#   2. a synthetic full-size Huginn-0125 folder written on that machine (bench.synthetic, ~7 GB under
#      /tmp there, never in the repository: the working tree that travels must stay under 64 MiB);
#   3. bench_fullsize on CUDA: load, the 32-token x 32-loop trace beside a plain torch loop over the
#      same weights, both against the GPU's bf16 matmul peak, and the refusal;
#   4. bench_fixed_point (issue 51): exact decoding by the fixed point against token-by-token decoding and
#      the fast path on CUDA: demo and hops (8 windows each), the synthetic Huginn's exact strip (32 tokens);
#   5. bench_readout: the Triton readout against the naive one on CUDA (after its CPU rows);
#   6. issue 11's pool benchmark on CUDA (demo-r8, hops), if the time budget allows.
# Each step runs under its own time limit, so one that hangs leaves the others their time; the whole
# stays within BUDGET seconds (default 380). Logs go to $OUT (the device tool's folder that comes
# back; at most 8 files) or ./gpu_out: summary.txt (the GPU, each step's exit status and seconds)
# and one log per step.
#
# Dry run on a machine without a GPU: DEVICE=cpu HUGINN=/tmp/full/huginn-0125 SERVE=quick bash bench/gpu_run.sh
# (the CUDA tests skip; an existing HUGINN folder is used as it is; SERVE=quick / 0: --quick pool runs / none).
# PY: a python with torch, triton, numpy, pandas, safetensors, tokenizers, tqdm and pytest (the device
# image's python3 has them; streamlit and datasets are not needed).
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-gpu_out}
DEVICE=${DEVICE:-cuda}
HUGINN=${HUGINN:-/tmp/gpu_run/huginn-0125}
SERVE=${SERVE:-1}
BUDGET=${BUDGET:-380}
export PYTHONUNBUFFERED=1 RECUR_CACHE_DIR=${RECUR_CACHE_DIR:-/tmp/recur_cache}
mkdir -p "$OUT"
START=$(date +%s)

# step NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S (cut to what the budget has left), log to $OUT/NAME.log
step() {
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$(( BUDGET - ($(date +%s) - START) ))
    (( limit > left )) && limit=$left
    if (( limit < 20 )); then
        echo "$name: skipped, ${left} s of the budget left" | tee -a "$OUT/summary.txt"
        return
    fi
    t0=$(date +%s)
    echo "== $name (limit ${limit} s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    tail -n 6 "$OUT/$name.log"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    echo "device $DEVICE, folder $HUGINN, budget $BUDGET s"
} 2>&1 | tee "$OUT/summary.txt"

step cuda_tests 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_readout_triton.py tests/test_readout.py \
    tests/test_serve.py -k cuda
if [ ! -f "$HUGINN/model.safetensors.index.json" ]; then
    rm -rf "$HUGINN"
    step synthetic 120 $PY -m bench.synthetic huginn-0125 "$HUGINN"
fi
step fullsize 120 $PY -m bench.bench_fullsize "$HUGINN" --device "$DEVICE" --skip-app
step fixed_point 90 $PY -m bench.bench_fixed_point --device "$DEVICE" --targets demo hops huginn \
    --huginn-folder "$HUGINN" --tokens 32 --skip-decode huginn
step readout 60 $PY -m bench.bench_readout --T 512 2048 --repeats 5
case $SERVE in
    0) ;;
    quick) step serve_demo_r8 60 $PY -m bench.bench_serve --device "$DEVICE" --quick ;;
    *) step serve_demo_r8 60 $PY -m bench.bench_serve --device "$DEVICE" --pools 32 --serve a2,latent --repeats 1 \
           --calibration bench/calibration/demo-r8.json
       step serve_hops 40 $PY -m bench.bench_serve --device "$DEVICE" --ckpt checkpoints/hops --pools 32 --serve latent \
           --repeats 1 --calibration bench/calibration/hops.json ;;
esac
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
