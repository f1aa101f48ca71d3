#!/usr/bin/env bash
# Set up graphsafe: a virtual environment in .venv with graphsafe, its test extras and
# transformers (the model tests' oracle). Idempotent: re-running only checks what is there.
#
# torch is never installed a second time. In this order:
# - PYTHON (default python3) imports torch, wherever its environment lives (the system's
#   packages, a venv, a uv or conda environment): .venv is made with that interpreter and
#   lists the directories of packages it sees in a .pth file of its own site-packages
#   (graphsafe_parent_env.pth), so that .venv imports that torch, triton and numpy. The
#   environment keeps its own versions (no pins). What the project needs beyond them is
#   installed into .venv (only then is the network needed), and graphsafe goes on .venv's
#   path through graphsafe_dev.pth (the repository, no build: no network).
#   `python3 -m venv --system-site-packages` would not do: from a venv's interpreter it
#   links the base interpreter's packages, not the venv's.
# - .venv already imports torch (an earlier run): kept.
# - no torch anywhere (CI's CPU machine): the CPU build torch==2.13.0 and every other
#   package at the versions of scripts/constraints.txt, graphsafe installed editable. This
#   needs the network. Never let pip resolve torch freely on a CPU machine: that pulls a
#   multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
PYTHON=${PYTHON:-python3}
VPY=$ROOT/.venv/bin/python

fail() {
    echo "setup.sh: $*" >&2
    exit 1
}
pyver() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }
torch_of() {  # "VERSION FILE" of the torch an interpreter finds, or nothing
    "$@" scripts/setup_env.py torch 2>/dev/null || true
}

command -v "$PYTHON" >/dev/null 2>&1 || fail "no interpreter PYTHON=$PYTHON: name a python >= 3.10, ideally one whose environment has torch (PYTHON=/path/to/python bash scripts/setup.sh)"
parent_torch=$(torch_of "$PYTHON")

if [ ! -x "$VPY" ]; then
    # pip only where it will install torch: a venv that reuses a torch gets pip when
    # something is missing (ensure_pip), and most often nothing is.
    if [ -n "$parent_torch" ] || ! "$PYTHON" -m venv .venv >/dev/null 2>&1; then
        rm -rf .venv
        "$PYTHON" -m venv --without-pip .venv || fail "$PYTHON -m venv .venv failed (see above)"
    fi
fi
ensure_pip() {  # pip in .venv: its own, or that of the environment it reuses, or ensurepip's (offline)
    "$VPY" -c "import pip" >/dev/null 2>&1 || "$VPY" -m ensurepip -q >/dev/null 2>&1 || "$VPY" -c "import pip" >/dev/null 2>&1
}
SITE=$("$VPY" scripts/setup_env.py site)
PARENT_PTH=$SITE/graphsafe_parent_env.pth
DEV_PTH=$SITE/graphsafe_dev.pth

venv_torch=$(torch_of "$VPY" -I)
own_torch=""
case "${venv_torch#* }" in "$(cd "$SITE" && pwd -P)"/*) own_torch=1 ;; esac
if [ -n "$parent_torch" ] && [ -z "$own_torch" ]; then
    [ "$(pyver "$PYTHON")" = "$(pyver "$VPY")" ] || fail ".venv runs Python $(pyver "$VPY"), PYTHON=$PYTHON is Python $(pyver "$PYTHON"): its packages cannot be shared; remove .venv (rm -rf .venv) and run this again"
    "$PYTHON" scripts/setup_env.py paths > "$PARENT_PTH"
    venv_torch=$(torch_of "$VPY" -I)
    [ -n "$venv_torch" ] || fail ".venv does not import torch through $PARENT_PTH (PYTHON=$PYTHON imports torch ${parent_torch%% *} from ${parent_torch#* })"
fi

if [ -z "$venv_torch" ]; then
    # The CPU build (CI's machine): every other package at the versions of
    # scripts/constraints.txt, so that a release elsewhere cannot change what CI runs.
    ensure_pip || fail "no pip in .venv (and ensurepip failed): install your distribution's venv package (python3-venv), or name another interpreter: PYTHON=/path/to/python bash scripts/setup.sh"
    "$VPY" -m pip install -q "torch==2.13.0" || fail "no torch in PYTHON=$PYTHON's environment nor in .venv, and pip could not install torch==2.13.0 (the CPU build; no network?). Either run this with network access, or point it at an interpreter whose environment has torch: PYTHON=/path/to/python bash scripts/setup.sh"
    venv_torch=$(torch_of "$VPY" -I)
    own_torch=1
fi

missing=$("$VPY" -I scripts/setup_env.py missing)
graphsafe_here() { (cd / && "$VPY" -I -c "import graphsafe, os, sys; sys.exit(not os.path.realpath(graphsafe.__file__).startswith('$ROOT/'))") >/dev/null 2>&1; }
if [ -n "$own_torch" ] && [ "${venv_torch%% *}" = "2.13.0+cpu" ]; then
    # CI's set-up, as it always was (pins, editable install); a re-run with everything
    # there installs nothing (and works offline).
    if [ -n "$missing" ] || ! graphsafe_here; then
        # oracle: transformers, the reference the model tests compare with (no torch dependency).
        "$VPY" -m pip install -q -c scripts/constraints.txt -e ".[test,oracle]" || fail "pip could not install graphsafe's requirements next to the CPU torch build (see above; the network is needed here)"
    fi
else
    # A torch that is reused as it is: only what is missing is installed, that torch pinned.
    if [ -n "$missing" ]; then
        echo "setup.sh: installing into .venv what torch's environment lacks:" $(echo "$missing" | sed 's/ *#.*//')
        reqs=$(mktemp)
        pin=$(mktemp)
        trap 'rm -f "$reqs" "$pin"' EXIT
        echo "$missing" > "$reqs"
        echo "torch==${venv_torch%% *}" > "$pin"
        { ensure_pip && "$VPY" -m pip install -q -r "$reqs" -c "$pin"; } || fail "$(printf '%s\n' \
            "torch ${venv_torch%% *} (from ${venv_torch#* }) is reused, but these requirements of graphsafe are not" \
            "satisfied there and pip could not install them (no network or no index reachable, or no pip):" \
            "$(echo "$missing" | sed 's/^/    /')" \
            "Install them into the environment that has torch ($PYTHON -m pip install ...), or into .venv" \
            "from a directory of wheels (.venv/bin/python -m pip install --no-index --find-links DIR ...)," \
            "or run this again with network access.")"
    fi
    # graphsafe itself: the repository on .venv's path (an editable install without a
    # build backend, build isolation or network).
    graphsafe_here || echo "$ROOT" > "$DEV_PTH"
fi
(cd / && "$VPY" -I -c "import torch, graphsafe, os; print(f'graphsafe {graphsafe.__version__} from {os.path.dirname(graphsafe.__file__)} with torch {torch.__version__} from {os.path.dirname(torch.__file__)}, cuda available: {torch.cuda.is_available()}')") || fail ".venv cannot import torch and graphsafe (see above)"
