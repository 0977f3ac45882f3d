#!/usr/bin/env bash
# Idempotent set-up of a machine for deepep_ascend: CPU torch, the package (editable) with its
# test, bench and hf extras, and the MPICH wheel's mpiexec. A fast no-op when all is in place.
#
# Environment:
#   PYTHON                       interpreter to install into (default: python, else python3)
#   DEEPEP_ASCEND_TORCH_VERSION  torch version to install if torch is missing (default 2.13.0)
#   DEEPEP_ASCEND_TORCH_INDEX    index URL for torch, e.g. https://download.pytorch.org/whl/cpu
#                                (a plain PyPI `torch` is the multi-GB CUDA build)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # cd "$REPO_ROOT", PYTHON
usage_if_help "$@"

# 1. torch (CPU build), before the package so its `torch>=2.1` is already satisfied.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch ${DEEPEP_ASCEND_TORCH_VERSION:-2.13.0}" \
         "${DEEPEP_ASCEND_TORCH_INDEX:+from $DEEPEP_ASCEND_TORCH_INDEX}" >&2
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install "torch==${DEEPEP_ASCEND_TORCH_VERSION:-2.13.0}" \
        ${DEEPEP_ASCEND_TORCH_INDEX:+--index-url "$DEEPEP_ASCEND_TORCH_INDEX"}
fi

# 2. The package, editable, with extras: reinstall only if something is missing, or the
#    installed distribution is not an editable install of *this* checkout, or one of the
#    repo's packages is not importable from outside the repo (new top-level package).
needs_install() {
    (cd / && "$PYTHON_BIN" - "$REPO_ROOT" <<'PY'
import importlib.metadata as md, importlib.util, json, os, sys
root = os.path.realpath(sys.argv[1])
why = [m for m in ("numpy", "mpi4py", "pytest", "pytest_mpi", "tqdm", "matplotlib", "jsonschema", "ruff",
                   "transformers") if importlib.util.find_spec(m) is None]
try:  # the hf extra's floor (pyproject.toml): an older transformers is upgraded
    if tuple(int(p) for p in md.version("transformers").split(".")[:2]) < (5, 18):
        why.append(f"transformers {md.version('transformers')} is older than 5.18")
except (md.PackageNotFoundError, ValueError):
    pass
try:
    dist = md.distribution("deepep_ascend")
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if not url.get("dir_info", {}).get("editable"):
        why.append("deepep_ascend not installed editable")
    elif os.path.realpath(url.get("url", "").removeprefix("file://")) != root:
        why.append(f"deepep_ascend installed from {url.get('url')}, not {root}")
except md.PackageNotFoundError:
    why.append("deepep_ascend not installed")
for pkg, folder in (("deepep_ascend", "deepep_ascend"), ("deepep_ascend.transports", "transports")):
    try:
        spec = importlib.util.find_spec(pkg)
    except ImportError:
        spec = None
    where = os.path.realpath(os.path.dirname(spec.origin)) if spec and spec.origin else None
    if where != os.path.join(root, folder):
        why.append(f"{pkg} resolves to {where}")
for stale in ("transports", "bench"):  # top-level names an older install of this checkout exported
    spec = importlib.util.find_spec(stale)
    if spec and spec.origin and os.path.realpath(spec.origin).startswith(root + os.sep):
        why.append(f"an older install exports the top-level package {stale}")
if why:
    print("setup: (re)installing because: " + "; ".join(why), file=sys.stderr)
    sys.exit(0)
sys.exit(1)
PY
    )
}
# The native kernel (an optional extension the install builds; without it the library uses its torch
# paths) and its calls' bindings (a second one, which needs Python's headers; without it the kernels are
# called through ctypes). `native_kernel check` exits 0 if they need a build: one missing or older than the
# sources (the bindings only where Python's headers are installed), a C compiler on PATH, and not already
# failed for these sources with this compiler here. `native_kernel
# record` after an install says when the build was skipped and remembers that it failed (no reinstall on
# every run); a later source or another compiler (`CC`) tries again.
native_kernel() {
    "$PYTHON" - "$REPO_ROOT" "$1" <<'PY'
import importlib.machinery, os, shutil, sys, sysconfig
pkg = os.path.join(os.path.realpath(sys.argv[1]), "deepep_ascend", "native")
csrc, failed = os.path.join(pkg, "csrc"), os.path.join(pkg, "_native.build-failed")
srcs = [os.path.join(csrc, f) for f in os.listdir(csrc) if f.endswith((".c", ".h"))] if os.path.isdir(csrc) else []
if not srcs:
    sys.exit(1)
newest = max(os.path.getmtime(p) for p in srcs)


def built(name):
    return any(os.path.isfile(p) and os.path.getmtime(p) >= newest
               for p in (os.path.join(pkg, name + s) for s in importlib.machinery.EXTENSION_SUFFIXES))


headers = os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
kernels = built("_native")
fresh = kernels and (built("_fastcall") or not headers)
cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
stamp = f"{newest!r} {shutil.which(cc) or cc}"  # these sources with this compiler: another one tries again
if sys.argv[2] == "check":
    tried = os.path.isfile(failed) and open(failed).read().strip() == stamp
    if fresh or tried or not shutil.which(cc):
        sys.exit(1)
    print("setup: (re)installing because: the native kernel is not built or older than its source", file=sys.stderr)
elif fresh:
    if os.path.isfile(failed):
        os.remove(failed)
    if not headers:
        print("setup: no Python headers (Python.h): the native kernels are called through ctypes, same results, "
              "slower calls (docs/install.md)", file=sys.stderr)
else:
    with open(failed, "w") as f:
        f.write(stamp)
    if kernels:
        print("setup: the native kernels' METH_FASTCALL bindings (deepep_ascend/native/csrc/bindings.c) were not "
              "built: the kernels are called through ctypes, same results, slower calls (docs/install.md)",
              file=sys.stderr)
    else:
        print("setup: the native kernels (deepep_ascend/native/csrc/) were not built (no working C compiler?): "
              "combine and MegaMoE use their torch paths, same results (the grouped GEMMs to bf16 rounding), "
              "slower (docs/install.md)",
              file=sys.stderr)
PY
}
if needs_install || native_kernel check; then
    "$PYTHON" -m pip install -e "$REPO_ROOT[test,bench,hf]"
    native_kernel record
fi

# 3. mpiexec: the one from the mpich wheel (matches mpi4py's libmpi). scripts/test.sh and
#    scripts/bench.sh put its directory first on PATH; report what a bare `mpiexec` runs.
wheel="$(mpich_wheel_mpiexec)"
onpath="$(resolved_path_mpiexec)"
if [[ -z "$wheel" ]]; then
    echo "setup: ERROR: the mpich wheel provides no mpiexec" >&2
    exit 1
fi
if [[ "$onpath" == "$wheel" ]]; then
    echo "setup: ok; mpiexec = $wheel (mpich wheel)" >&2
else
    echo "setup: ok; mpich wheel mpiexec = $wheel; WARNING: bare 'mpiexec' on PATH runs" \
         "${onpath:-nothing}; scripts/test.sh and scripts/bench.sh use the wheel's" >&2
fi
