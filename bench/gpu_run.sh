#!/usr/bin/env bash
# The one device run for a session that is lent a GPU: the CUDA-only tests, then issue 11's pool
# benchmark on the GPU for demo-r8 and hops. Run it from the repository root (bash bench/gpu_run.sh).
# Logs go to $OUT (the device tool's folder that comes back) or ./gpu_out. PY: a python with torch,
# numpy, pandas, safetensors, tokenizers and pytest (the device image's python3 has them; streamlit
# and datasets are not needed).
#
# Sized for a short device lease (about 5 minutes, estimated):
# - the thresholds come from bench/calibration/ (searched on the CPU; a teacher-forced quality does
#   not depend on the device beyond float rounding), so no device time goes to the search;
# - pools 8 and 32 only: at pool 1 the 64 x 128-token requests run one at a time, about 65k
#   launch-bound steps for A0@8 alone.
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-gpu_out}
export PYTHONUNBUFFERED=1 RECUR_CACHE_DIR=${RECUR_CACHE_DIR:-/tmp/recur_cache}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -rs tests/test_readout_triton.py tests/test_serve.py -k "cuda" 2>&1 | tee "$OUT/cuda_tests.log"
$PY -m bench.bench_serve --device cuda --pools 8,32 --serve a2,latent --repeats 2 \
    --calibration bench/calibration/demo-r8.json 2>&1 | tee "$OUT/serve_demo_r8.log"
$PY -m bench.bench_serve --device cuda --ckpt checkpoints/hops --pools 32 --serve latent --repeats 2 \
    --calibration bench/calibration/hops.json 2>&1 | tee "$OUT/serve_hops.log"
