#!/usr/bin/env bash
# Set up graphsafe on a fresh machine: a virtual environment in .venv with graphsafe
# (editable) and its test extras. Idempotent: re-running only checks what is there.
#
# torch: a machine that already has torch (a GPU image) lends it to the venv through
# --system-site-packages; otherwise the CPU build torch==2.13.0 is installed. Never let
# pip resolve torch freely on a CPU machine: that pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        "$PYTHON" -m venv --system-site-packages .venv
    else
        "$PYTHON" -m venv .venv
    fi
fi
VPY=.venv/bin/python
PINS=()
if ! "$VPY" -c "import torch" >/dev/null 2>&1 || "$VPY" -c "import sys, torch; sys.exit(torch.__version__ != '2.13.0+cpu')"; then
    # The CPU build (CI's machine): every other package at the versions of
    # scripts/constraints.txt, so a release elsewhere cannot change what CI runs.
    "$VPY" -m pip install -q "torch==2.13.0"
    PINS=(-c scripts/constraints.txt)
fi
# oracle: transformers, the reference the model tests compare with (no torch dependency).
"$VPY" -m pip install -q "${PINS[@]}" -e ".[test,oracle]"
"$VPY" -c "import torch, graphsafe; print(f'graphsafe {graphsafe.__version__} with torch {torch.__version__}, cuda available: {torch.cuda.is_available()}')"
