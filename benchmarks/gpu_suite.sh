#!/usr/bin/env bash
# One call on the GPU machine: install, every CUDA test, then the benchmarks, each
# with its full log under $OUT (the call's reply keeps only the tail). Run from the
# repository root with the FLA wheels carried in .whl/ (see docs/benchmarks.md).
#   bash benchmarks/gpu_suite.sh [seconds per stage, default 150]
# Compiling the kernels took most of each stage on a cold machine (2026-11-30), and every
# call may get a cold one. So the Triton and Inductor caches come back as
# $OUT/gpu-cache.tar.gz; put that file in .gpu-cache/ here and carry .gpu-cache (and
# .whl) on the next call: the suite unpacks it and compiles only what changed.
set -uo pipefail
limit=${1:-150}
out=${OUT:-/tmp/gpu_suite}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cache=/tmp/gpu-cache
mkdir -p "$cache"
[ -f .gpu-cache/gpu-cache.tar.gz ] && tar xzf .gpu-cache/gpu-cache.tar.gz -C "$cache"
export TRITON_CACHE_DIR=$cache/triton TORCHINDUCTOR_CACHE_DIR=$cache/inductor
pip install -q --no-deps --no-build-isolation -e . > "$out/pip.log" 2>&1 || tail "$out/pip.log"
if ls .whl/*.whl > /dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1 \
        && export PYTHONPATH=/tmp/site
fi
# The benchmarks run as scripts from benchmarks/: put the checkout on the path too (a cold
# machine once failed "import kdn_compile" there, 2026-11-30).
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
stage() {  # name, command...
    local name=$1; shift
    echo "== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   rc=$? ($(tail -n 1 "$out/$name.log"))"
}
stage capture python -m pytest -q -p no:cacheprovider -rf tests/test_gpu_capture.py
stage two_key python -m pytest -q -p no:cacheprovider -rf tests/test_two_key_kernels.py
stage gdn python -m pytest -q -p no:cacheprovider -rf tests/test_gdn_kernels.py
stage gain python -m pytest -q -p no:cacheprovider -rf tests/test_kalman_gain_kernels.py
stage bench_layers python benchmarks/bench_layers.py --layers gdn,kda,kdn
stage bench_gdn python benchmarks/bench_gdn.py
stage bench_kda python benchmarks/bench_kda.py
grep -h -A3 "^FAILED\|Error" "$out"/*.log | head -60
# Files come back up to 16 MiB each: keep the Triton cache alone if both are larger.
tar czf "$out/gpu-cache.tar.gz" -C "$cache" . 2> /dev/null
if [ "$(stat -c %s "$out/gpu-cache.tar.gz")" -gt 16000000 ]; then
    tar czf "$out/gpu-cache.tar.gz" -C "$cache" triton
fi
echo "cache: $(du -h "$out/gpu-cache.tar.gz" | cut -f1) in gpu-cache.tar.gz"
