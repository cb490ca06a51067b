#!/usr/bin/env bash
# The checks only a GPU can make, as one script for a lent CUDA machine (its own python3 with a
# CUDA torch; convbn from src/). Logs go to $OUT (default ./gpu_out), written as each step ends,
# so a run stopped early still leaves what it finished. Steps, in order of what matters most:
#   1. every CUDA test (tests/test_cuda*.py and the CUDA tests of the convert-peak / max_batch files)
#   2. convert's own peak and time against one eager step (bm_convert_cost --device cuda)
#   3. the per-sample-norm nets' peak / time table: eager, convert, checkpointing, torch.compile
#      with and without an activation-memory budget, convert + compile, in fp32 and bf16 (bm_gpu table)
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1
PY=${PY:-python3}
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/env.log" 2>&1

step() {  # step NAME TIMEOUT CMD...: run CMD with a time limit, its output to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$OUT/steps.log"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/steps.log"
    tail -n 25 "$OUT/$name.log"
}

step tests 200 $PY -m pytest -q -p no:cacheprovider -n 8 -rfEs tests/test_cuda.py tests/test_cuda_norms.py \
    tests/test_convert_peak.py tests/test_max_batch_bound.py -k cuda
step convert_cost 120 $PY benchmarks/bm_convert_cost.py --device cuda --models r18 r50 --rounds 1
NETS=benchmarks/bm_norm_peaks.py
step diffusion_bf16 150 $PY benchmarks/bm_gpu.py table --model $NETS:DiffusionUNet --batch-size 32 --image-size 128 \
    --amp bf16 --configs eager auto checkpoint compile compile0.5 convert+compile --steps 10 --warmup 2
step unet3d 150 $PY benchmarks/bm_gpu.py table --model $NETS:InstanceUNet3d --batch-size 2 --image-size 96 \
    --amp none bf16 --configs eager auto checkpoint compile0.5 --steps 10 --warmup 2
step diffusion_fp32 90 $PY benchmarks/bm_gpu.py table --model $NETS:DiffusionUNet --batch-size 32 --image-size 128 \
    --amp none --configs eager auto checkpoint compile0.5 --steps 10 --warmup 2
step convnext_bf16 90 $PY benchmarks/bm_gpu.py table --model $NETS:ConvNeXtNet --batch-size 64 --image-size 128 \
    --amp bf16 --configs eager auto checkpoint compile0.5 --steps 10 --warmup 2
