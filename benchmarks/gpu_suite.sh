#!/usr/bin/env bash
# One call on the GPU machine: install, the CUDA tests, then the benchmarks. Run from the
# repository root with the FLA wheels carried in .whl/ (see docs/benchmarks.md):
#   [TESTS="gdn two_key gain capture [diag]"] [BENCHES="gdn kda layers"] [LAYERS=gdn,kda,kdn] \
#   [EXTRA=<dir> EXTRA_BENCH="--sweep"] bash benchmarks/gpu_suite.sh [total seconds, 570]
# What comes back under $OUT: summary.txt (one line per stage and per test), logs.tar.gz
# (every log) and the benchmarks' JSON: the device tool returns only a few files.
#
# Lessons of 2026-11-30: compiling took most of each call (every call starts cold; the
# Triton + Inductor caches, 90 MB packed, are too large to come back), and one illegal
# memory access failed every later test of its process. So:
# * every test runs in its own process (-p sync_launches: a synchronize after each kernel
#   names the one that failed), many at a time: each compiles on its own CPU core, and
#   the tests put little load on the GPU;
# * small-shape runs of the benchmarks, concurrent with the tests, compile the kernel
#   variants of the timed runs (tiles depend on batch and heads, not on T);
# * the timed benchmarks then run one at a time, alone on the GPU.
# TESTS=diag runs benchmarks/diagnose_gdn.py (GDN kernel configurations by head size).
# ISO_K: a pytest -k expression selecting the tests of every test stage.
# TESTS_SHARE: percent of the time for the tests and compile warm-ups (35); GDN_ARGS,
# KDA_ARGS, LAYERS_ARGS: arguments of bench_gdn.py, bench_kda.py, bench_layers.py (e.g.
# "--profile --shapes 8x4096x16", "--profile").
# WARM=0: no small-shape warm-up runs (FLA's autotuning alone outlasts the test
# stages there, so the timed runs wait for them; 2026-12-01).
# BENCH_LIMIT: seconds for each timed bench_gdn / bench_kda run (150).
# TUNE="pairs rows fwd-state bwd-state": after the benchmarks, benchmarks/tune_two_key.py
# --kernel <each> $TUNE_ARGS (e.g. "--shape 1x32768x16") in the time left.
# EXTRA=<dir>: another checkout inside this one (a branch); its GDN kernel tests (unless
# EXTRA_TESTS=0) and bench_gdn.py (with $EXTRA_BENCH) run too, with its own kdn_compile
# first on the path.
set -uo pipefail
total=${1:-570}
[ "$total" -ge 60 ] || { echo "total seconds must be at least 60, got $total"; exit 2; }
start=$SECONDS
out=${OUT:-/tmp/gpu_suite}
logs=/tmp/gpu_suite_logs
rm -rf "$logs"
mkdir -p "$out" "$logs"
summary=$out/summary.txt
note() { echo "$*" | tee -a "$summary"; }
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > "$logs/pip.log" 2>&1 \
    || note "editable install failed: $(tail -n 3 "$logs/pip.log")"
site=
if ! ls .whl/*.whl > /dev/null 2>&1; then
    note "no .whl/*.whl carried: benchmarks run without FLA"
elif python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        > "$logs/wheels.log" 2>&1; then
    site=/tmp/site
else
    note "FLA wheels did not install: $(tail -n 3 "$logs/wheels.log")"
fi
root=$PWD
[ -n "${EXTRA:-}" ] && [ ! -d "${EXTRA:-}" ] && note "EXTRA=$EXTRA is not a directory here"
left() { echo $(( total - 15 - (SECONDS - start) )); }  # 15 s to pack the logs
stage() {  # name, limit, command... (in the current directory, with its PYTHONPATH)
    local name=$1 limit=$2; shift 2
    [ "$limit" -gt "$(left)" ] && limit=$(left)
    if [ "$limit" -le 5 ]; then note "== $name: no time left"; return; fi
    timeout "$limit" "$@" > "$logs/$name.log" 2>&1
    note "== $name rc=$? after $((SECONDS - start)) s ($(tail -n 1 "$logs/$name.log"))"
}
isolated() {  # name, limit, test file: each test in its own process, $ISO_JOBS (4) at a time;
    # the whole stage ends within limit seconds (a test that would start later is not run)
    local name=$1 limit=$2 file=$3
    export ISO_PLUGIN=${4--p sync_launches}  # capture tests: none (no syncs while capturing)
    [ "$limit" -gt "$(left)" ] && limit=$(left)
    mkdir -p "$logs/$name"
    python -m pytest -q -p no:cacheprovider --collect-only ${ISO_K:+-k "$ISO_K"} "$file" \
        > "$logs/$name/collect.log" 2>&1
    grep "::" "$logs/$name/collect.log" > "$logs/$name/ids"
    if [ ! -s "$logs/$name/ids" ]; then
        note "== $name: no tests collected ($(tail -n 1 "$logs/$name/collect.log"))"
        return
    fi
    export ISO_DEADLINE=$(( $(date +%s) + limit )) ISO_DIR=$logs/$name
    # shellcheck disable=SC2016
    xargs -P "${ISO_JOBS:-4}" -d '\n' -I{} bash -c 'id="$1"; log="$ISO_DIR/$(echo "$id" | md5sum | cut -c1-8).log"
        rest=$(( ISO_DEADLINE - $(date +%s) ))
        if [ "$rest" -le 5 ]; then echo "rc=none $id: not run, no time left"; exit 0; fi
        timeout "$rest" python -m pytest -q -p no:cacheprovider $ISO_PLUGIN -rf "$id" \
            > "$log" 2>&1; echo "rc=$? $id: $(tail -n 1 "$log")"' _ {} < "$logs/$name/ids" \
        > "$logs/$name/results"
    local passed skipped
    passed=$(grep -c "^rc=0 .* passed" "$logs/$name/results")
    skipped=$(grep "^rc=0 " "$logs/$name/results" | grep -vc " passed")
    note "== $name after $((SECONDS - start)) s: $passed passed, $skipped skipped, of" \
         "$(wc -l < "$logs/$name/ids")"
    grep -v "^rc=0 " "$logs/$name/results" | sed 's/^/   /' | tee -a "$summary"
    cat "$logs/$name"/*.log > "$logs/$name.log" 2> /dev/null
}
checkout() {  # dir: run the rest of the line with that checkout first on the path
    cd "$1" && export PYTHONPATH=${site:+$site:}$PWD:$root/benchmarks
}
checkout "$root"
tests_limit=$(( $(left) * ${TESTS_SHARE:-35} / 100 ))
small_gdn="8x128x16x16,1x128x16x16,4x128x16x32"
for t in ${TESTS:-gdn two_key gain capture}; do
    case $t in
        capture) isolated capture "$tests_limit" tests/test_gpu_capture.py "" & ;;
        diag) stage diagnose_gdn "$tests_limit" env OUT="$out" python benchmarks/diagnose_gdn.py \
                  --jobs "${DIAG_JOBS:-6}" & ;;
        gain) isolated gain "$tests_limit" tests/test_kalman_gain_kernels.py & ;;
        *) isolated "$t" "$tests_limit" "tests/test_${t}_kernels.py" & ;;
    esac
done
for b in ${BENCHES:-gdn kda layers}; do
    [ "${WARM:-1}" = 1 ] || break
    case $b in
        gdn) stage warm_gdn "$tests_limit" env OUT= python benchmarks/bench_gdn.py \
                 --shapes "$small_gdn" & ;;
        kda) stage warm_kda "$tests_limit" env OUT= python benchmarks/bench_kda.py \
                 --shapes 8x128x16,1x128x16 & ;;
        layers) stage warm_layers "$tests_limit" python benchmarks/bench_layers.py \
                    --layers "${LAYERS:-gdn,kda,kdn}" --batch 1 --length 256 & ;;
    esac
done
if [ -n "${EXTRA:-}" ] && [ "${EXTRA_TESTS:-1}" = 1 ]; then
    ( checkout "$EXTRA" && isolated extra_gdn "$tests_limit" tests/test_gdn_kernels.py ) &
fi
if [ -n "${EXTRA:-}" ]; then
    ( checkout "$EXTRA" && stage extra_warm_gdn "$tests_limit" env OUT= python \
          benchmarks/bench_gdn.py ${EXTRA_BENCH:-} --shapes "$small_gdn" ) &
fi
wait
if [ -n "${EXTRA:-}" ]; then
    ( checkout "$EXTRA" && mkdir -p "$out/extra" && stage extra_bench_gdn 200 \
          env OUT="$out/extra" python benchmarks/bench_gdn.py ${EXTRA_BENCH:-} )
fi
for b in ${BENCHES:-gdn kda layers}; do
    case $b in
        # shellcheck disable=SC2086
        layers) stage bench_layers 300 python benchmarks/bench_layers.py \
                    --layers "${LAYERS:-gdn,kda,kdn}" ${LAYERS_ARGS:-} ;;
        none) ;;
        *) args=${b^^}_ARGS  # e.g. GDN_ARGS="--profile --shapes 8x4096x16x16"
           # shellcheck disable=SC2086
           stage "bench_$b" "${BENCH_LIMIT:-150}" python "benchmarks/bench_$b.py" ${!args:-} ;;
    esac
done
for t in ${TUNE:-}; do
    # shellcheck disable=SC2086
    stage "tune_$t" "$(left)" env OUT="$out" python benchmarks/tune_two_key.py --kernel "$t" \
        ${TUNE_ARGS:-}
done
grep -h -B2 -A12 "CUDA error in\|^E   .*[Ee]rror" "$logs"/*.log 2> /dev/null | head -150 \
    > "$out/errors.txt"
tar czf "$out/logs.tar.gz" -C "$logs" . 2> /dev/null
note "done after $((SECONDS - start)) s"
