#!/usr/bin/env bash
# The GPU checks that belong together in one call on a lent GPU machine (run by hand; results in BENCHMARKS.md).
#   1. the CUDA tests: tests/test_capture_gpu.py and tests/test_simulate.py (skipped on a machine without a GPU)
#   2. the `pe` sweep trained longer (STEPS steps of 32 x 128 tokens, JOBS models at once on the one GPU, default 4), the
#      attention sinks of every model, and the report's two sweep claims judged on them (benchmarks/sweep.py)
# Usage: bash benchmarks/gpu_checks.sh OUT_DIR [TOKENS_DIR]
#   TOKENS_DIR: the embedded corpus's bpe-2048 token directory (default: the poslens cache's); STEPS (default 8000)
#   WARMUP (default 200) and SEQUENCES (held-out sequences per model for the claims, default 32) from the environment.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [TOKENS_DIR]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
tokens=${2:-$("$PY" -c "from poslens.train.tokens import default_tokens; print(default_tokens('bpe:2048'))")}
nvidia-smi -L 2>/dev/null
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
timeout "${TEST_TIMEOUT:-180}" "$PY" -m pytest -q -p no:cacheprovider tests/test_capture_gpu.py tests/test_simulate.py \
  2>&1 | tee "$out/tests.log"
cache=$(mktemp -d)
timeout "${SWEEP_TIMEOUT:-420}" "$PY" benchmarks/sweep.py --preset pe --cache "$cache" --jobs "${JOBS:-4}" --judge \
  --leakage-sequences "${SEQUENCES:-32}" \
  --train "steps=${STEPS:-8000}+warmup=${WARMUP:-200}+batch_size=32+micro_batch=32+eval_every=2000+save_every=0+tokens=$tokens" \
  --json "$out/sweep_gpu.json" 2>&1 | grep -v "Loading weights" | tee "$out/sweep.log"
