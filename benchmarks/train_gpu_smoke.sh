#!/usr/bin/env bash
# The built-in trainer on the GPU machine (no Slurm there): 2 ranks via swiftslurm.train.launch, bf16,
# ZeRO-2 and ZeRO-3, tiny model. Wheels carried in .whl-train/ (see ../shared/notes/deepspeed-and-gpu.md).
# Usage there: bash benchmarks/train_gpu_smoke.sh   (writes logs and metrics.jsonl under $OUT/)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/train-gpu-smoke}
mkdir -p "$OUT"
if [ -d .whl-train ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl-train/*.whl && export PYTHONPATH=/tmp/site
fi
# not installed there: make the package layout of setup.cfg (swiftslurm.ds_config = ds_config/) importable
if ! python3 -c "import swiftslurm.ds_config" 2>/dev/null; then
  rm -rf /tmp/swiftslurm-src && mkdir -p /tmp/swiftslurm-src && cp -r swiftslurm /tmp/swiftslurm-src/ \
    && cp -r ds_config /tmp/swiftslurm-src/swiftslurm/ds_config && cp -r templates /tmp/swiftslurm-src/swiftslurm/templates
  export PYTHONPATH=/tmp/swiftslurm-src:${PYTHONPATH:-}
  RUN_DIR=/tmp/swiftslurm-src  # not the checkout: `python -m` puts the cwd first on sys.path
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for ds in ${DEEPSPEED:-zero2 zero3}; do
  cat > /tmp/gpu_$ds.toml <<EOF
[job]
name = "gpu-smoke"
output_dir = "/tmp/gpu_$ds"
[slurm]
gpus_per_node = 2
[train]
model = "tiny-llama"
dataset = ["$PWD/examples/data/alpaca_demo.jsonl", "$PWD/examples/data/messages_demo.jsonl"]
train_type = "full"
deepspeed = "$ds"
bf16 = true
gradient_checkpointing = true
per_device_train_batch_size = 8
learning_rate = 3e-3
lr_scheduler_type = "constant"
max_steps = 40
max_length = 128
save_steps = 20
logging_steps = 10
[checkpoint]
keep = 2
forced_save_fractions = []
EOF
  rm -rf /tmp/gpu_$ds
  (cd "${RUN_DIR:-.}" && python3 -m swiftslurm.train.launch /tmp/gpu_$ds.toml --nprocs 2 --out /tmp/gpu_$ds > "$OUT/$ds.log" 2>&1)
  echo "$ds exit $?"
  cp /tmp/gpu_$ds/metrics.jsonl "$OUT/$ds.metrics.jsonl" 2>/dev/null
  ls /tmp/gpu_$ds /tmp/gpu_$ds/checkpoint-40 2>&1 | tr '\n' ' '; echo
  grep -A6 "swiftslurm: training" "$OUT/$ds.log"
done
