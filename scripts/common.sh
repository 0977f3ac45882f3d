# shellcheck shell=bash
# Shared by scripts/*.sh (sourced, not executed): repo root, interpreter, MPICH-wheel mpiexec.
#   REPO_ROOT   absolute path of this checkout; the caller is cd'ed there
#   PYTHON      interpreter command (env PYTHON, default `python`, else `python3`)
#   PYTHON_BIN  its absolute path (sys.executable), used under mpiexec to skip shims

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

if [[ -z "${PYTHON:-}" ]]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
PYTHON_BIN="$("$PYTHON" -c 'import sys; print(sys.executable)')"

# Absolute path of the `mpiexec` shipped by the `mpich` wheel (empty if not installed).
mpich_wheel_mpiexec() {
    "$PYTHON" - <<'PY'
import importlib.metadata as md, os
try:
    dist = md.distribution("mpich")
except md.PackageNotFoundError:
    raise SystemExit(0)
for f in dist.files or ():
    if f.name == "mpiexec" and f.parent.name == "bin":
        print(os.path.realpath(dist.locate_file(f)))
        break
PY
}

# Resolve what `mpiexec` on PATH really runs (follows pyenv shims and symlinks).
resolved_path_mpiexec() {
    local p
    p="$(command -v mpiexec 2>/dev/null || true)"
    [[ -z "$p" ]] && return 0
    if [[ "$p" == */shims/mpiexec ]] && command -v pyenv >/dev/null 2>&1; then
        p="$(pyenv which mpiexec 2>/dev/null || echo "$p")"
    fi
    realpath "$p" 2>/dev/null || echo "$p"
}

# Put the mpich wheel's bin dir first on PATH so `mpiexec` is the one matching mpi4py's libmpi, and then
# $PYTHON's own dir before it, so that `python` stays the same interpreter: in a venv made with
# --system-site-packages the wheel's bin dir is the base interpreter's, whose `python` would otherwise win
# (unless $PYTHON's dir holds another mpiexec).
use_wheel_mpiexec() {
    local wheel
    wheel="$(mpich_wheel_mpiexec)"
    if [[ -n "$wheel" ]]; then
        export PATH="$(dirname "$wheel"):$PATH"
        local own
        own="$(dirname "$PYTHON_BIN")"
        if [[ "$own" != "$(dirname "$wheel")" && ! -e "$own/mpiexec" ]]; then
            export PATH="$own:$PATH"
        fi
    fi
    echo "mpiexec: $(command -v mpiexec || echo 'NOT FOUND')" >&2
}

# `-h` / `--help` among a script's arguments: print the script's header comment and exit 0, before any set-up
# runs (call as `usage_if_help "$@"` right after sourcing this file).
usage_if_help() {
    local arg
    for arg in "$@"; do
        case "$arg" in
            -h|--help)
                sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "${BASH_SOURCE[1]}"
                exit 0 ;;
        esac
    done
}
