#!/usr/bin/env bash
# The GPU checks, as one short script for a machine with NVIDIA GPUs and `bash scripts/bootstrap.sh gpu,dev`
# done (ray, deepspeed, vllm installed): the GPU-marked tests (DeepSpeed bf16 ZeRO-2 and ZeRO-3 + CPU offload
# through Ray Train with the zero_to_fp32 export; vLLM generation).  There is no GPU scoring-throughput benchmark
# yet (benchmarks/bench_token_utility.py times the CPU).  Output: logs under ${OUT:-gpu_check_out}/.  A few
# minutes on one H100/H200; never run by CI.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
py="${PYTHON:-.venv/bin/python}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L | tee "$out/gpus.txt"
"$py" -c "import torch, ray, deepspeed; print('torch', torch.__version__, 'ray', ray.__version__, 'deepspeed', deepspeed.__version__)" \
  | tee -a "$out/gpus.txt"
"$py" -m pytest -m gpu -q -s -p no:cacheprovider tests/test_train_stage.py tests/test_generation_actors.py 2>&1 \
  | tee "$out/gpu_tests.log"
exit "${PIPESTATUS[0]}"
