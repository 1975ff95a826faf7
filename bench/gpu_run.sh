#!/usr/bin/env bash
# The one device run for a session that is lent a GPU (not yet run: no GPU so far): the CUDA-only
# tests, then issue 11's pool benchmark on the GPU for demo-r8 and hops. Logs go to $OUT (the device
# tool's folder that comes back) or ./gpu_out. PY: the python with this project's requirements.
set -uo pipefail
PY=${PY:-python}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -m pytest -q -rs tests/test_readout_triton.py tests/test_serve.py -k "cuda" 2>&1 | tee "$OUT/cuda_tests.log"
$PY bench/bench_serve.py --device cuda --repeats 2 2>&1 | tee "$OUT/serve_demo_r8.log"
$PY bench/bench_serve.py --device cuda --ckpt checkpoints/hops --pools 32 --repeats 2 2>&1 | tee "$OUT/serve_hops.log"
