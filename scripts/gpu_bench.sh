#!/usr/bin/env bash
# One-device GPU benchmark (issue #15): BRIDGE JVP token utilities on a Llama-3B-shaped model (bf16), exact-W1 head
# scoring at the Llama-2-7B attention shape, an exact BDS step vs a plain LoRA step, and the HF generation path's
# tokens/s -- see benchmarks/gpu_bench.py.  Needs only torch, transformers, peft, pyarrow and safetensors on a CUDA
# machine (no Ray, DeepSpeed, vLLM, network or downloads: every model is built from a config with random init).
# Run from anywhere; output: ${OUT:-gpu_bench_out}/gpu_bench.json (rewritten after every part) and gpu_bench.log.
# Under 8 minutes on one H200 (hard stop at 470 s; the parts finished by then are in the JSON).  Extra arguments go to
# the benchmark, e.g. `scripts/gpu_bench.sh --part-budget 60`.  Never run by CI.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_bench_out}"
mkdir -p "$out"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi -L > "$out/gpus.txt" 2>&1 || true
timeout -k 10 470 "$py" benchmarks/gpu_bench.py --out "$out" "$@" 2>&1 | tee "$out/gpu_bench.log"
exit "${PIPESTATUS[0]}"
