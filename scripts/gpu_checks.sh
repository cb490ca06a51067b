#!/usr/bin/env bash
# The checks only a GPU can make, as one script for a lent CUDA machine (its own python3 with a
# CUDA torch; convbn from src/). Logs go to $OUT (default ./gpu_out), written as each step ends,
# so a run stopped early still leaves what it finished. STEPS picks steps (default: all, in order):
#   tests         every CUDA test (tests/test_cuda*.py and the CUDA tests of other files: -k cuda)
#   convert_cost  convert's own peak and time against one eager step (bm_convert_cost --device cuda)
#   norm_nets     the per-sample-norm nets' peak / time table: eager, convert, checkpointing,
#                 torch.compile with and without an activation-memory budget, convert + compile,
#                 fp32 and bf16 (bm_gpu table on bm_norm_peaks.py's nets)
#   eager_norm_times  norm_nets' eager-mode rows only (eager, convert, checkpointing) in bf16
#   library_nets  the same for MONAI BasicUNet 3-D, diffusers UNet2DModel and timm convnext_atto
#                 (benchmarks/gpu_nets.py; MONAI and diffusers are installed from .whl/ when the
#                 machine lacks them: see the device notes)
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests:benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
STEPS=${STEPS:-tests convert_cost norm_nets library_nets}
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

table() {  # table NAME TIMEOUT SPEC BATCH SIZE AMPS CONFIGS
    step "$1" "$2" $PY benchmarks/bm_gpu.py table --model "$3" --batch-size "$4" --image-size "$5" \
        --amp $6 --configs $7 --steps 10 --warmup 2
}

for s in $STEPS; do
    case $s in
    tests)
        step tests 240 $PY -m pytest -q -p no:cacheprovider -n 8 -rfEs tests/test_cuda.py tests/test_cuda_norms.py \
            tests/test_convert_peak.py tests/test_max_batch_bound.py tests/test_memory.py tests/test_norm_chain_ops.py \
            tests/test_norm_allocator_peak.py tests/test_lean_pools.py -k cuda ;;
    convert_cost)
        step convert_cost 150 $PY benchmarks/bm_convert_cost.py --device cuda --models r18 r50 --rounds 1 --phases ;;
    norm_nets)
        N=benchmarks/bm_norm_peaks.py
        table diffusion_bf16 150 $N:DiffusionUNet 32 128 bf16 "eager auto checkpoint compile compile0.5 convert+compile"
        table unet3d 150 $N:InstanceUNet3d 2 96 "none bf16" "eager auto checkpoint compile0.5"
        table diffusion_fp32 90 $N:DiffusionUNet 32 128 none "eager auto checkpoint compile0.5"
        table convnext_bf16 90 $N:ConvNeXtNet 64 128 bf16 "eager auto checkpoint compile0.5" ;;
    eager_norm_times)  # the per-sample-norm nets' eager-mode rows alone (no compile): convert's time on the GPU
        N=benchmarks/bm_norm_peaks.py
        table diffusion_bf16_eager 60 $N:DiffusionUNet 32 128 bf16 "eager auto checkpoint"
        table convnext_bf16_eager 60 $N:ConvNeXtNet 64 128 bf16 "eager auto checkpoint" ;;
    library_nets)
        G=benchmarks/gpu_nets.py
        table basicunet3d 150 $G:basicunet3d 2 96 "none bf16" "eager auto checkpoint compile0.5"
        table diffusers_unet 120 $G:diffusers_unet 16 128 "bf16" "eager auto compile0.5 convert+compile"
        table convnext_atto 90 $G:convnext_atto 64 224 "bf16" "eager auto checkpoint compile0.5" ;;
    *) echo "unknown step $s" ;;
    esac
done
