# Sourced by the GPU benchmarks on the GPU machine (no registry there): install the carried wheels
# (.whl/: deepspeed, pydantic, submitit, ... and swiftslurm itself, built here by `make gpu-wheels`)
# into /tmp/site, and keep NVLink multicast off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
