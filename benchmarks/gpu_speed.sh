#!/usr/bin/env bash
# The GPU speed figures owed by BENCHMARKS.md, in one call on a lent GPU machine (run by hand):
#   1. the `small` preset's training step against a hand-written PyTorch step, with its MFU (benchmarks/train.py)
#   2. the hook engine's capture against the previous release's and a plain forward, Llama-3.1-8B's shape in bf16
#      (benchmarks/capture_vs_release.py; the release's files from an exported tree: the machine has no git history)
#   3. the CUDA tests (tests/test_capture_gpu.py, tests/test_simulate.py)
# Usage: bash benchmarks/gpu_speed.sh OUT_DIR TOKENS_DIR RELEASE_TREE
#   TOKENS_DIR: the embedded corpus tokenized for SmolLM2 (`default_tokens('smollm2')` on a machine with the cache)
#   RELEASE_TREE: `git archive afb3a39 src | tar -x -C RELEASE_TREE`
set -uo pipefail
out=${1:?usage: gpu_speed.sh OUT_DIR TOKENS_DIR RELEASE_TREE}; tokens=${2:?}; release=${3:?}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
nvidia-smi -L 2>/dev/null
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
timeout "${TRAIN_TIMEOUT:-240}" "$PY" benchmarks/train.py --preset small --device cuda --tokens "$tokens" \
  --pairs "${PAIRS:-40}" --json "$out/train_small.json" 2>&1 | grep -v "Loading weights" | tail -n 25 | tee "$out/train.log"
timeout "${CAPTURE_TIMEOUT:-180}" "$PY" benchmarks/capture_vs_release.py --release-src "$release" --shape llama-3.1-8b \
  --device cuda --dtype bfloat16 --batch 4 --seq-len 1024 --batches 4 --repeats "${REPEATS:-7}" \
  --out "$out/capture_vs_release.json" 2>&1 | tail -n 3 | tee "$out/capture.log"
timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -q -p no:cacheprovider tests/test_capture_gpu.py tests/test_simulate.py \
  2>&1 | tail -n 5 | tee "$out/tests.log"
