#!/usr/bin/env bash
# kdn_compile's one entry point: sets everything up (idempotent), then runs a task.
#
#   ./dev.sh demo [flags]     train the demo language model (kdn-compile demo)
#   ./dev.sh test [pytest..]  run the test suite (installs transformers for its integration tests)
#   ./dev.sh docs             build the Sphinx docs with warnings as errors
#   ./dev.sh check            capture report of the public functions on this device
#   ./dev.sh bench [flags]    time the kernels on a CUDA GPU (kdn-compile bench)
#   ./dev.sh gpu [TIER] [pytest..]  the GPU tests on a CUDA machine: TIER is smoke (the
#                             default), full, or one full-tier group: kernels, capture,
#                             distributed, models (tests/conftest.py; docs/testing.md)
#
# Set-up: a virtual environment in .venv, made by the interpreter that starts
# ./dev.sh (`python3`, or $PYTHON). Where that interpreter already has torch >= 2.11
# (a virtualenv, conda, or the system) .venv sees its packages through a .pth file
# and keeps that torch; otherwise .venv gets torch==2.13.0 and triton==3.9.0 (the CPU
# build where pip is configured to serve it, as on the project's CI machines; from
# plain PyPI on Linux the CUDA build). Then whatever is missing of the packages every
# task needs (BASE_PINS), of the task's own tools (TEST_PINS for test, DOCS_PINS for
# docs), and this package, editable. Each install is announced on one line
# ("dev.sh: installing ...") before it starts. Nothing is installed into the starting
# interpreter's environment and nothing is replaced.
set -euo pipefail
cd "$(dirname "$0")"

TORCH_PIN="torch==2.13.0"
TRITON_PIN="triton==3.9.0"
# Every task: setuptools (the editable install runs without build isolation, and a Python
# 3.12+ venv has none), tqdm (the demo's progress) and numpy.
BASE_PINS=("setuptools==84.2.1" "tqdm==4.70.1" "numpy")
# `./dev.sh test` only: pytest and expecttest; transformers (the integration's tests; its
# own dependencies come with it, torch is not one of them), hypothesis (the property-based
# tests; 6.168.5 is its newest release with wheels for Python 3.10, the oldest Python this
# package supports) and pytest-xdist (`./dev.sh test -n 2` runs the suite on two
# processes, as CI does).
TEST_PINS=("pytest==9.2.0" "expecttest==0.3.0" "transformers==5.23.0" "hypothesis==6.168.5"
           "pytest-xdist==3.8.0")
# `./dev.sh docs` only: Sphinx and its markdown reader.
DOCS_PINS=("sphinx==9.0.4" "myst-parser==5.2.0")

# The directories that hold the starting interpreter's packages (torch's first).
OUTER_SITE='import os, site, sys, torch
dirs = [os.path.dirname(os.path.dirname(torch.__file__))] + site.getsitepackages()
if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
print("\n".join(dict.fromkeys(d for d in dirs if os.path.isdir(d))))'

say() { echo "dev.sh: $*" >&2; }

# pip quiet, each install announced first: a long one is never a silent wait.
pip_install() {
    python -m pip install -q --disable-pip-version-check "$@"
}

install_missing() {
    for pin in "$@"; do
        module=${pin%%==*}
        module=${module//-/_}
        # an older setuptools (a venv's own) cannot build the editable install's wheel
        [ "$module" = setuptools ] && module=setuptools.command.bdist_wheel
        [ "$module" = pytest_xdist ] && module=xdist
        if ! python -c "import $module" 2>/dev/null; then
            say "installing $pin ..."
            pip_install "$pin" || say "could not install $pin (offline?); continuing"
        fi
    done
}

# setup [PIN...]: .venv, torch and Triton where missing, BASE_PINS and the given pins
# where missing, this package editable.
setup() {
    local torch_ok='import sys, torch; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 11))'
    local python=${PYTHON:-python3}
    if [ -x .venv/bin/python ] && [ -n "${PYTHON:-}" ]; then
        say ".venv exists; PYTHON=$PYTHON is used only to create it (rm -rf .venv to" \
            "set up again with that interpreter)"
    fi
    if [ ! -x .venv/bin/python ]; then
        if "$python" -c "$torch_ok" 2>/dev/null; then
            say "creating .venv with $python, reusing its torch" \
                "$("$python" -c 'import torch; print(torch.__version__)')"
            "$python" -m venv .venv
            local site
            site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
            "$python" -c "$OUTER_SITE" > "$site/_kdn_outer_env.pth"
        else
            say "creating .venv with $python (no torch >= 2.11 there)"
            "$python" -m venv .venv
        fi
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    if ! python -c "$torch_ok" 2>/dev/null; then
        say "installing $TORCH_PIN (about a minute where pip serves the CPU build; plain PyPI" \
            "on Linux serves the multi-GB CUDA build) ..."
        pip_install "$TORCH_PIN"
    fi
    if [ "$(uname -s)" = Linux ] && ! python -c 'import triton' 2>/dev/null; then
        say "installing $TRITON_PIN ..."
        pip_install "$TRITON_PIN"
    fi
    install_missing "${BASE_PINS[@]}" "$@"
    # The console script is the mark of the editable install (importing from the
    # checkout would succeed without it).
    if [ ! -x .venv/bin/kdn-compile ]; then
        say "installing kdn_compile from this checkout (editable) ..."
        pip_install --no-deps --no-build-isolation -e .
    fi
}

# The GPU tiers run with the interpreter that has torch with CUDA (python3, or $PYTHON) and
# install nothing: GPU machines are often offline. The checkout is put on PYTHONPATH, so the
# package need not be installed. Tests spread over worker processes (pytest-xdist, where
# installed): Triton and Inductor compile in each in parallel, sharing their caches.
gpu() {
    local tier=${1:-smoke}
    [ $# -gt 0 ] && shift
    local select
    case "$tier" in
        smoke) select="gpu and not slow" ;;
        full) select="gpu" ;;
        kernels|capture|distributed|models) select="gpu and $tier" ;;
        *) echo "dev.sh gpu: unknown tier '$tier' (smoke, full, kernels, capture, distributed, models)" >&2
           exit 2 ;;
    esac
    local python=${PYTHON:-python3}
    if ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        echo "dev.sh gpu: $python has no torch with a CUDA device" >&2
        exit 2
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kdn-triton-cache}
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/kdn-inductor-cache}
    local parallel=()
    if "$python" -c 'import xdist' 2>/dev/null; then
        local workers
        workers=$("$python" -c 'import os; print(max(1, min(12, (os.cpu_count() or 2) - 2)))')
        # one compile thread per worker: the workers already use the cores
        export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
        parallel=(-n "$workers" --dist loadgroup)
    fi
    exec "$python" -m pytest tests -m "$select" -p no:cacheprovider "${parallel[@]}" "$@"
}

# `tests` unless the arguments name test files or folders (a path, or path::test) themselves.
test_paths() {
    for arg in "$@"; do
        [ -e "${arg%%::*}" ] && case "$arg" in -*) ;; *) return ;; esac
    done
    echo tests
}

task=${1:-}
[ $# -gt 0 ] && shift
case "$task" in
    demo)  setup; exec kdn-compile demo "$@" ;;
    check) setup; exec kdn-compile check "$@" ;;
    bench) setup; exec kdn-compile bench "$@" ;;
    test)  setup "${TEST_PINS[@]}"; exec python -m pytest $(test_paths "$@") "$@" ;;
    gpu)   gpu "$@" ;;
    docs)  setup "${DOCS_PINS[@]}"; exec python -m sphinx -W --keep-going -b html docs docs/_build/html "$@" ;;
    *)     sed -n '2,11p' "$0"; exit 2 ;;
esac
