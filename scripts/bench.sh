#!/usr/bin/env bash
# The main job: NP ranks (default 4) of `python -m bench normal` (the normal-mode benchmark), extra args passed on
# (`python -m bench normal --help`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # cd "$REPO_ROOT", PYTHON, PYTHON_BIN
usage_if_help "$@"

[[ "${DEEPEP_ASCEND_SKIP_SETUP:-0}" == 1 ]] || bash "$REPO_ROOT/scripts/setup.sh"
use_wheel_mpiexec
exec mpiexec -n "${NP:-4}" "$PYTHON_BIN" -m bench normal "$@"
