#!/usr/bin/env bash
# Wheels for the GPU machine (no registry there; Python 3.12, torch/transformers/accelerate preinstalled):
# what swiftslurm and its GPU benchmarks need beyond that image, into .whl/ (git-ignored; carried by the
# device tool, installed by benchmarks/gpu/setup.sh). Usage: bash scripts/gpu-wheels.sh [extra NAME==VER ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
pure=(deepspeed hjson py-cpuinfo pydantic annotated-types typing-inspection submitit cloudpickle
      python-hostlist typer click shellingham rich markdown-it-py mdurl pygments peft tensorboard
      tensorboard-data-server markdown werkzeug absl-py transformers trl nvidia-ml-py datasets dill liger-kernel==0.8.5
      huggingface_hub httpx2 httpcore2 truststore anyio h11 tomlkit "$@")
# datasets (TRL's trainers and our DPO/RM/KTO/GRPO data path import it) needs dill and multiprocess beyond the image,
# which has pyarrow, pandas, fsspec, aiohttp, requests, pyyaml (device README's package list); multiprocess ships
# per-Python wheels (py312), so it is downloaded for 3.12 like the binary ones
# transformers >= 5.25 needs huggingface_hub >= 2.4 (the image has 1.x) and requires `kernels` (its import is checked
# even though swiftslurm loads models with use_kernels=False); hub 2.x brings httpx2/httpcore2/truststore and hf-xet
binary=(pydantic-core xxhash msgpack multiprocess hf-xet kernels)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for name in "${binary[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "$name==$(ver "$name")"
done
for spec in "${pure[@]}"; do
  case $spec in *==*) want=$spec ;; *) want="$spec==$(ver "$spec")" ;; esac
  name=${want%%==*}
  ls .whl | grep -qi "^${name//-/_}-" && continue
  # deepspeed ships only an sdist: build a pure wheel of it here (its ops JIT-build on first use there)
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$want"
done
du -sh .whl
# swiftslurm itself, from this checkout
rm -f .whl/swiftslurm-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl . && ls .whl/swiftslurm-*.whl
