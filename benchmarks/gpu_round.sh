#!/usr/bin/env bash
# The GPU figures owed by issue #34 (item 7), in one call on a lent GPU machine (run by hand; results in
# BENCHMARKS.md "On a GPU, 2026-11-28"). Each step has its own time limit, so one slow step cannot take the others:
#   0. the CUDA tests (tests/test_capture_gpu.py, test_simulate.py, test_train_gpu.py)
#   1. the `small` preset's training step against a hand-written step: MFU, and one step's costliest kernels
#      (benchmarks/train.py --profile)
#   2. `poslens leakage` against plain forwards over the same sequences (benchmarks/leakage.py), on a random model of
#      SmolLM2-135M's shape at the defaults and at 128 x 512 tokens, then of Llama-3.1-8B's shape at 128 x 512
#      (benchmarks/random_model.py writes them; random weights: timings of the shape, not of trained numbers)
#   3. `poslens length` on the SmolLM2-shaped model against plain forwards at its evaluation lengths
#      (benchmarks/length.py --plain)
#   4. the sweep's `pe-sinks` models trained as one computation against the same models alone, two at a time
#      (benchmarks/sweep_batched.py): models per minute on the GPU
#   ATTENTION="cudnn auto" (the default) tries the training step's SDPA kernels in turn until one runs (auto: torch's
#   choice; flash, cudnn, efficient, math).
#   Every step's limit can be set (TEST_LIMIT, TRAIN_LIMIT, LEAK_LIMIT, LENGTH_LIMIT, SWEEP_LIMIT, LEAK8_LIMIT), and
#   SKIP="name name" leaves steps out (default: corpus and the 512-token and 8B-shaped leakage steps; SKIP= runs
#   every step), so the round fits one call of a session's device time: the default steps' limits add up to 575 s,
#   and the round of 2026-11-29 took 403 s with them (BENCHMARKS.md "On a GPU, 2026-11-29"). The length step runs
#   under cProfile and is interrupted 15 s before its limit, so a run cut short still leaves OUT/length.prof.
# Usage: bash benchmarks/gpu_round.sh OUT_DIR CARRY_DIR
#   CARRY_DIR holds tokens-smollm2/ and tokens-bpe/ (the embedded corpus's token directories for SmolLM2's tokenizer
#   and the 2,048-entry BPE, from the poslens cache) and smol-tok/ (SmolLM2-135M's config and tokenizer files).
# A dry run on a CPU (every step, small): DEVICE=cpu DTYPE=float32 PRESET=tiny PAIRS=2 SEQ=128 NSEQ=16
#   BIG=smollm2-135m SWEEP_STEPS=5 TRAIN_LEN=64 bash benchmarks/gpu_round.sh /tmp/dry CARRY_DIR
set -uo pipefail
out=${1:?usage: gpu_round.sh OUT_DIR CARRY_DIR}; carry=${2:?}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export POSLENS_CACHE=${POSLENS_CACHE:-/tmp/poslens-cache}
PY=${PY:-python3}
dev=${DEVICE:-cuda}; dtype=${DTYPE:-bfloat16}; seq=${SEQ:-512}; nseq=${NSEQ:-128}; big=${BIG:-llama-3.1-8b}
work=$(mktemp -d)
last_rc=  # the exit status of the last step run (none yet)
step() { local name=$1 limit=$2; shift 2
  case " ${SKIP-corpus leakage-135m-512 model-big leakage-big-512} " in *" $name "*) echo "=== $name: skipped (SKIP)"; return;; esac
  echo "=== $name ($(date -u +%T), limit ${limit}s): $*"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -e "Loading weights" -e "Writing model shards"
  last_rc=${PIPESTATUS[0]}; echo "=== $name: exit $last_rc after $((SECONDS - t0)) s"; }
nvidia-smi -L 2>/dev/null
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
step tests "${TEST_LIMIT:-60}" "$PY" -m pytest -q -p no:cacheprovider tests/test_capture_gpu.py tests/test_simulate.py \
  tests/test_train_gpu.py
for attn in ${ATTENTION:-cudnn auto}; do  # the first kernel that runs; the next only if it fails
  step train-$attn "${TRAIN_LIMIT:-110}" "$PY" benchmarks/train.py --preset "${PRESET:-small}" --device "$dev" \
    --tokens "$carry/tokens-smollm2" --pairs "${PAIRS:-12}" --attention "$attn" --profile \
    --json "$out/train_small_$attn.json"
  [ "$last_rc" = 0 ] && break
done
step corpus 120 "$PY" -c "from poslens.engine.data import iter_documents; print(sum(1 for _ in iter_documents(None)),
'documents in the embedded corpus')"
step model-135m 60 "$PY" benchmarks/random_model.py --shape smollm2-135m --device "$dev" --dtype "$dtype" \
  --tokenizer "$carry/smol-tok" --out "$work/m135"
step leakage-135m-defaults "${LEAK_LIMIT:-60}" "$PY" benchmarks/leakage.py --model "$work/m135" --device "$dev" --dtype "$dtype" \
  ${DEFAULTS_FLAGS:-} --out "$out/leakage_135m_defaults.json"
step leakage-135m-$seq "${LEAK_LIMIT:-60}" "$PY" benchmarks/leakage.py --model "$work/m135" --device "$dev" --dtype "$dtype" \
  --seq-len "$seq" --num-sequences "$nseq" --out "$out/leakage_135m_long.json"
length_limit=${LENGTH_LIMIT:-165}
step length-135m "$length_limit" "$PY" benchmarks/length.py --model "$work/m135" --data "$carry/tokens-smollm2" \
  --device "$dev" --dtype "$dtype" --plain --out "$work/length-run" --json "$out/length_135m.json" \
  --profile "$out/length.prof" --limit $((length_limit - 15)) -- --train-len "${TRAIN_LEN:-256}" \
  ${LENGTH_FLAGS:-}
step sweep-batched "${SWEEP_LIMIT:-120}" "$PY" benchmarks/sweep_batched.py --steps "${SWEEP_STEPS:-100}" --rounds "${SWEEP_ROUNDS:-2}" \
  --tokens "$carry/tokens-bpe" --device "$dev" --json "$out/sweep_batched.json"
step model-big 150 "$PY" benchmarks/random_model.py --shape "$big" --device "$dev" --dtype "$dtype" \
  --tokenizer "$carry/smol-tok" --out "$work/mbig"
step leakage-big-$seq "${LEAK8_LIMIT:-150}" "$PY" benchmarks/leakage.py --model "$work/mbig" --device "$dev" \
  --dtype "$dtype" --seq-len "$seq" --num-sequences "$nseq" --out "$out/leakage_big_long.json"
rm -rf "$work"
