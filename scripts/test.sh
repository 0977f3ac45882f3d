#!/usr/bin/env bash
# Run the whole test suite at 1, 2, 4 and 8 ranks; stop at the first failing rank count. The 1-rank job runs
# as concurrent jobs of alternate test files ("shards"; docs/testing.md).
#   scripts/test.sh [pytest args...]     (default args: tests)
# Environment (declared in deepep_ascend/settings.py, table in docs/configuration.md; every one set is
# validated first): DEEPEP_ASCEND_TEST_RANKS, DEEPEP_ASCEND_SUITE_TIMEOUT_S, DEEPEP_ASCEND_TEST_HANG_RETRIES,
# DEEPEP_ASCEND_TEST_SHARDS, DEEPEP_ASCEND_SKIP_SETUP, DEEPEP_ASCEND_TEST_WATCHDOG_S; DEEPEP_ASCEND_TIMEOUT_S is
# exported with the suite's default of 20 s; UCX_LOG_LEVEL is exported (default error; see below).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # cd "$REPO_ROOT", PYTHON, PYTHON_BIN
usage_if_help "$@"

[[ "${DEEPEP_ASCEND_SKIP_SETUP:-0}" == 1 ]] || bash "$REPO_ROOT/scripts/setup.sh"
use_wheel_mpiexec
"$PYTHON_BIN" "$REPO_ROOT/deepep_ascend/settings.py" check   # every bad DEEPEP_ASCEND_* value, named

export DEEPEP_ASCEND_TIMEOUT_S="${DEEPEP_ASCEND_TIMEOUT_S:-20}"
# Tests that abort or time out a multi-node transport abandon its RMA windows on purpose (a poisoned
# window cannot be freed collectively); at MPI_Finalize UCX then warns once per registration
# (~1,900 lines per suite). Errors still print.
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"
# The script's own variables as parsed there (bash would read "010" as octal, or fail on "2_0").
setting() { "$PYTHON_BIN" "$REPO_ROOT/deepep_ascend/settings.py" get "$1"; }
T="$(setting DEEPEP_ASCEND_SUITE_TIMEOUT_S)"
if [[ $# -eq 0 ]]; then set -- tests; fi

# A job that the harness's watchdog ended (a test hung) runs once more, saying so, if no test had
# failed before the hang: each rank whose watchdog fires writes a marker ("clean" or "failed",
# tests/conftest.py) into $DEEPEP_ASCEND_TEST_HANG_DIR. Every wait of the library has a deadline
# and turns into an error, so a watchdog hang is outside its data plane; the ones seen before were
# tests slowed 100x by ranks spinning in MPICH's blocking collectives (docs/testing.md),
# which the harness no longer does. A failing or crashing test is never re-run.
retries="$(setting DEEPEP_ASCEND_TEST_HANG_RETRIES)"
shards="$(setting DEEPEP_ASCEND_TEST_SHARDS)"
# The host, for the failure lines below (CI shows only part of a log; its tail survives).
host_flags="$( (grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_bf16|amx_tile' | xargs) 2>/dev/null || true)"
quota="$(cat /sys/fs/cgroup/cpu.max 2>/dev/null || true)"
host="$(nproc) cores${quota:+ (cgroup cpu.max $quota)}, $( (grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) 2>/dev/null || true), ${host_flags:-no avx2}, kernel $(uname -r)"
echo "=== host: $host ===" >&2
work="$(mktemp -d)"
# On the way out (a signal included) stop every job still running. Each job's timeout leads a process group
# of its own (mpiexec, its proxies and ranks in it), which a signal to the script's group does not reach:
# run_job records it as $work/job-<pid> while it runs.
cleanup() {
    local job
    for job in "$work"/job-*; do
        [[ -e "$job" ]] && kill -TERM -- "-${job##*/job-}" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
# Every rank of every job imports and collects the same modules: Python keeps their compiled code (and
# pytest its rewritten test modules) in __pycache__ beside the sources (ignored by git) even where
# PYTHONDONTWRITEBYTECODE is set; without it each process compiles them all again.
unset PYTHONDONTWRITEBYTECODE
# Only the pytest plugins the suite uses (pytest-mpi; pytester from tests/conftest.py): others installed
# alongside would be imported by every rank, and could change how tests run.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

# run_job N SHARD [pytest args...]: the suite at N ranks in one mpiexec (SHARD: "i/n", the test files
# that job runs, tests/conftest.py; empty: all), run again after a watchdog hang as described above.
# Prints its status line; returns pytest's exit status.
run_job() {
    local n=$1 shard=$2
    shift 2
    local what="$n rank(s)${shard:+ (shard $shard)}" dir="$work/hang-$n-${shard/\//-}"
    local attempt=0 rc start markers again=""
    mkdir -p "$dir"
    while :; do
        echo "=== pytest at $what ===" >&2
        start=$SECONDS
        rm -f "$dir"/rank*
        rc=0
        DEEPEP_ASCEND_TEST_SHARD="$shard" DEEPEP_ASCEND_TEST_HANG_DIR="$dir" timeout -k 10 "$T" \
            mpiexec -n "$n" "$PYTHON_BIN" -m pytest -p pytest_mpi --with-mpi -q "$@" &
        local job="$work/job-$!"
        touch "$job"
        wait "$!" || rc=$?
        rm -f "$job"
        markers=("$dir"/rank*)
        if [[ $rc -ne 0 && $attempt -lt $retries && -e "${markers[0]}" ]] && ! grep -qx failed "${markers[@]}"; then
            attempt=$((attempt + 1))
            echo "$what" >> "$work/hung"
            echo "=== $what: HUNG (exit $rc after $((SECONDS - start)) s, no test had failed; the watchdog's report is above; host: $host); running the job again ($attempt of $retries) ===" >&2
            continue
        fi
        break
    done
    [[ $attempt -gt 0 ]] && again=", after $attempt hung run(s)"
    case $rc in
        0) echo "=== $what: passed ($((SECONDS - start)) s$again) ===" >&2 ;;
        5) echo "=== $what: no tests to run (ok) ===" >&2 ;;
        124|137) echo "=== $what: TIMED OUT after $T s (exit $rc; host: $host) ===" >&2 ;;
        *) echo "=== $what: FAILED (exit $rc$again; host: $host) ===" >&2 ;;
    esac
    return "$rc"
}

# --lf and --sw choose what to collect from pytest's cache, which concurrent jobs would rewrite under each
# other, and --cache-clear empties it while the other job may be writing
for arg in "$@" ${PYTEST_ADDOPTS:-}; do
    case $arg in
        --lf|--last-failed|--sw|--stepwise|--sw-skip|--stepwise-skip|--cache-clear)
            [[ $shards -gt 1 ]] && echo "=== $arg: the 1-rank job runs as one job ===" >&2
            shards=1 ;;
    esac
done

for n in ${DEEPEP_ASCEND_TEST_RANKS:-1 2 4 8}; do
    rc=0
    if [[ $n -eq 1 && $shards -gt 1 ]]; then
        # One rank leaves a core idle for much of the job (its tests run in one process, some launch small
        # jobs of their own): its test files are split among concurrent jobs. The first prints as it runs,
        # the others' output follows once all are done, job by job.
        start=$SECONDS
        pids=()
        for ((i = 0; i < shards; i++)); do
            if [[ $i -eq 0 ]]; then
                run_job 1 "$i/$shards" "$@" &
            else
                run_job 1 "$i/$shards" "$@" > "$work/out$i" 2>&1 &
            fi
            pids+=("$!")
        done
        statuses=()
        for pid in "${pids[@]}"; do
            s=0
            wait "$pid" || s=$?
            statuses+=("$s")
        done
        for ((i = 1; i < shards; i++)); do cat "$work/out$i"; done
        rc=5  # every job had nothing to run, unless one passed or failed
        for s in "${statuses[@]}"; do
            if [[ $s -ne 0 && $s -ne 5 ]]; then rc=$s; break; fi
            [[ $s -eq 0 ]] && rc=0
        done
        case $rc in
            0) echo "=== 1 rank(s): passed ($((SECONDS - start)) s, $shards concurrent jobs) ===" >&2 ;;
            5) ;;
            *) echo "=== 1 rank(s): FAILED (exit statuses of its $shards concurrent jobs: ${statuses[*]}; host: $host) ===" >&2 ;;
        esac
    else
        run_job "$n" "" "$@" &   # waited for in the background, so that an interrupt is handled at once
        wait "$!" || rc=$?
    fi
    case $rc in
        0|5) ;;
        *) exit "$rc" ;;
    esac
done
if [[ -s "$work/hung" ]]; then
    echo "=== passed, but $(wc -l < "$work/hung") job(s) hung first and were run again (HUNG lines above) ===" >&2
fi
