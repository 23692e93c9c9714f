#!/usr/bin/env bash
# Runs tests the way CI meets them, on a busy machine: N runs in a row with CPU hogs
# beside them, then each test's pass count. A test that fails once in twenty here is a
# test that will fail CI one day; fix it at the cause (docs: README, "Testing").
#
#   scripts/flake-hunt.sh [--runs N] [--hogs H] [--logs DIR] -- CARGO_TEST_ARGS...
#   scripts/flake-hunt.sh [--runs N] [--hogs H] [--logs DIR] --pytest PYTEST_ARGS...
#
#   scripts/flake-hunt.sh --runs 20 -- -p kvgate --test replicas_e2e
#   scripts/flake-hunt.sh --runs 3 -- --workspace           # the whole cargo test
#   scripts/flake-hunt.sh --runs 5 --pytest crates/kvgate-py/tests/test_native.py
#
# Cargo tests are built once before the first run (the build is not timed as a run).
# --pytest runs the test venv's pytest (${KVGATE_PY_VENV:-target/py-venv}, made by
# scripts/test.sh) with KVGATE_BIN set as scripts/test.sh sets it. Hogs are busy shell
# loops (default 2: as many as this 2-core CI machine has cores), killed on exit. Every
# run's output is kept in the logs folder; a failing run's log is named in the summary.
# Exits 1 if any test failed in any run.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=10
hogs=2
logs=""
mode=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --hogs) hogs="$2"; shift 2 ;;
        --logs) logs="$2"; shift 2 ;;
        --) mode=cargo; shift; break ;;
        --pytest) mode=pytest; shift; break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "flake-hunt: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z "$mode" ]]; then
    echo "flake-hunt: give the tests after -- (cargo test arguments) or --pytest (see --help)" >&2
    exit 2
fi
logs="${logs:-$(mktemp -d /tmp/flake-hunt.XXXXXX)}"
mkdir -p "$logs"
TARGET="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
VENV="$(realpath -m "${KVGATE_PY_VENV:-$TARGET/py-venv}")"

hog_pids=()
stop_hogs() {
    for p in "${hog_pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
}
trap stop_hogs EXIT INT TERM

if [[ "$mode" == cargo ]]; then
    echo "== building: cargo test --no-run $*"
    cargo test --no-run "$@" >"$logs/build.log" 2>&1 || {
        echo "flake-hunt: the build failed; see $logs/build.log" >&2
        tail -20 "$logs/build.log" >&2
        exit 2
    }
fi

for _ in $(seq "$hogs"); do
    (while :; do :; done) &
    hog_pids+=("$!")
done
echo "== $runs runs with $hogs CPU hogs beside; logs in $logs"

results="$logs/results.tsv"
: >"$results"
for run in $(seq "$runs"); do
    log="$logs/run-$run.log"
    start=$SECONDS
    if [[ "$mode" == cargo ]]; then
        cargo test "$@" >"$log" 2>&1
        rc=$?
        # libtest's lines: "test NAME ... ok" / "... FAILED" (a binary's name precedes
        # its tests as "Running tests/x.rs (target/...)").
        awk -v run="$run" '
            /^     Running / { bin = $2 }
            /^test .* \.\.\. (ok|FAILED)$/ {
                name = $2; for (i = 3; $i != "..."; i++) name = name " " $i
                print run "\t" bin "::" name "\t" $NF
            }' "$log" >>"$results"
    else
        KVGATE_BIN="$TARGET/debug/kvgate" "$VENV/bin/python" -m pytest -q -rA -p no:cacheprovider "$@" >"$log" 2>&1
        rc=$?
        awk -v run="$run" '/^(PASSED|FAILED|ERROR) / {
            s = ($1 == "PASSED") ? "ok" : "FAILED"; print run "\t" $2 "\t" s }' "$log" >>"$results"
    fi
    failed=$(awk -F'\t' -v run="$run" '$1 == run && $3 == "FAILED"' "$results" | wc -l)
    echo "run $run/$runs: exit $rc, $failed failed, $((SECONDS - start)) s"
    if [[ $rc -ne 0 && $failed -eq 0 ]]; then
        # A crash or a build error names no test: count it against the run itself.
        printf '%s\t%s\t%s\n' "$run" "(the run itself: exit $rc)" FAILED >>"$results"
    fi
done

stop_hogs
trap - EXIT INT TERM
echo
echo "== passes per test over $runs runs ($hogs hogs)"
awk -F'\t' '
    { seen[$2]++; if ($3 == "ok") ok[$2]++; else bad[$2] = bad[$2] " " $1 }
    END { for (t in seen) printf "%4d/%-4d %s%s\n", ok[t], seen[t], t, (t in bad) ? "   failed in runs:" bad[t] : "" }
' "$results" | sort -k2
total=$(cut -f2 "$results" | sort -u | wc -l)
failures=$(awk -F'\t' '$3 == "FAILED"' "$results" | wc -l)
echo "$total tests; $failures failures; logs: $logs"
[[ $failures -eq 0 ]]
