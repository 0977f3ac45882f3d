#!/usr/bin/env bash
# Run the whole test suite at 1, 2, 4 and 8 ranks; stop at the first failing rank count.
#   scripts/test.sh [pytest args...]     (default args: tests)
# Environment (declared in deepep_ascend/settings.py, table in docs/configuration.md; every one set is
# validated first): DEEPEP_ASCEND_TEST_RANKS, DEEPEP_ASCEND_SUITE_TIMEOUT_S, DEEPEP_ASCEND_TEST_HANG_RETRIES,
# DEEPEP_ASCEND_SKIP_SETUP, DEEPEP_ASCEND_TEST_WATCHDOG_S; DEEPEP_ASCEND_TIMEOUT_S is exported with the
# suite's default of 20 s; UCX_LOG_LEVEL is exported (default error; see below).
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
T="$(echo "${DEEPEP_ASCEND_SUITE_TIMEOUT_S:-1200}" | xargs)"
if [[ $# -eq 0 ]]; then set -- tests; fi

# A job that the harness's watchdog ended (a test hung) runs once more, saying so, if no test had
# failed before the hang: each rank whose watchdog fires writes a marker ("clean" or "failed",
# tests/conftest.py) into $DEEPEP_ASCEND_TEST_HANG_DIR. Every wait of the library has a deadline
# and turns into an error, so a watchdog hang is outside its data plane; the ones seen before were
# tests slowed 100x by ranks spinning in MPICH's blocking collectives (docs/testing.md),
# which the harness no longer does. A failing or crashing test is never re-run.
retries="$(echo "${DEEPEP_ASCEND_TEST_HANG_RETRIES:-1}" | xargs)"
# The host, for the failure lines below (CI shows only part of a log; its tail survives).
host_flags="$( (grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_bf16|amx_tile' | xargs) 2>/dev/null || true)"
quota="$(cat /sys/fs/cgroup/cpu.max 2>/dev/null || true)"
host="$(nproc) cores${quota:+ (cgroup cpu.max $quota)}, $( (grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) 2>/dev/null || true), ${host_flags:-no avx2}, kernel $(uname -r)"
echo "=== host: $host ===" >&2
hang_dir="$(mktemp -d)"
trap 'rm -rf "$hang_dir"' EXIT
hung_total=0
for n in ${DEEPEP_ASCEND_TEST_RANKS:-1 2 4 8}; do
    attempt=0
    while :; do
        echo "=== pytest at $n rank(s) ===" >&2
        start=$SECONDS
        rm -f "$hang_dir"/rank*
        rc=0
        DEEPEP_ASCEND_TEST_HANG_DIR="$hang_dir" timeout -k 10 "$T" mpiexec -n "$n" "$PYTHON_BIN" -m pytest --with-mpi -q "$@" || rc=$?
        markers=("$hang_dir"/rank*)
        if [[ $rc -ne 0 && $attempt -lt $retries && -e "${markers[0]}" ]] && ! grep -qx failed "${markers[@]}"; then
            attempt=$((attempt + 1))
            hung_total=$((hung_total + 1))
            echo "=== $n rank(s): HUNG (exit $rc after $((SECONDS - start)) s, no test had failed; the watchdog's report is above; host: $host); running the $n-rank job again ($attempt of $retries) ===" >&2
            continue
        fi
        break
    done
    again=""
    [[ $attempt -gt 0 ]] && again=", after $attempt hung run(s)"
    case $rc in
        0) echo "=== $n rank(s): passed ($((SECONDS - start)) s$again) ===" >&2 ;;
        5) echo "=== $n rank(s): no tests to run at this rank count (ok) ===" >&2 ;;
        124|137) echo "=== $n rank(s): TIMED OUT after $T s (exit $rc; host: $host) ===" >&2; exit "$rc" ;;
        *) echo "=== $n rank(s): FAILED (exit $rc$again; host: $host) ===" >&2; exit "$rc" ;;
    esac
done
if [[ $hung_total -gt 0 ]]; then
    echo "=== passed, but $hung_total job(s) hung first and were run again (HUNG lines above) ===" >&2
fi
