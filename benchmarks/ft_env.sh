#!/usr/bin/env bash
# A free-threaded CPython 3.13 (python3.13t, built with --disable-gil) and a venv holding what
# the dataset zoo (benchmarks/zoo.py) needs, both outside the repository (make ft-env runs this).
#
#   CPYTHON_SRC  a CPython 3.13 source tree, needed only when $FT_PREFIX has no python3.13t yet:
#                  git clone --depth 1 --branch v3.13.5 https://github.com/python/cpython
#                or an unpacked release tarball (python.org/ftp/python/3.13.5/Python-3.13.5.tar.xz).
#                It is configured out of tree, so it must not have been built in place (make
#                distclean there first if it was).
#   FT_PREFIX    where the interpreter is installed (default /tmp/ft-python)
#   FT_VENV      the venv (default /tmp/ft-venv)
#   FT_TORCH     the torch release (default 2.12.0: PyPI's last with cp313t wheels; its Linux
#                wheels are CUDA builds, several GB with their nvidia-* and cuda-* packages)
#   FT_CONFIGURE_OPTS  extra configure flags, e.g. "--enable-optimizations --with-lto" (the
#                default build has neither, like a plain pyenv build; PGO takes several times
#                longer)
#   JOBS         make -j (default: the number of cores)
#
# Debian build dependencies: build-essential libssl-dev zlib1g-dev libffi-dev libbz2-dev
# liblzma-dev libsqlite3-dev libreadline-dev libncurses-dev uuid-dev.
#
# Every package installed has a cp313t wheel or is pure Python (pyyaml, which datasets needs,
# is built from its sdist: it has no cp313t wheel), and all but one declare that they run
# without the GIL: the last step checks that importing torch, numpy, PIL, pyarrow, datasets,
# torchdata, scipy and torchtune_pipe leaves sys._is_gil_enabled() False with no PYTHON_GIL=0,
# and names the first module that turns it on if one does. The exception is triton (a torch
# dependency): its triton._C.libtriton turns the GIL on, with a RuntimeWarning, once
# torch._dynamo or torch.compile imports it; nothing the zoo runs does. A process that must
# import it and keep the GIL off runs with PYTHON_GIL=0 (or -X gil=0).
#
# About 4 minutes on 2 cores: the interpreter builds in 2 to 2.5 (no PGO) and takes 0.4 GB; the
# venv takes 5.2 GB, most of it torch's CUDA libraries. Run the zoo's smoke test with
#   $FT_VENV/bin/python -m benchmarks.zoo --quick --out /tmp/zoo-ft.json
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FT_PREFIX=${FT_PREFIX:-/tmp/ft-python}
FT_VENV=${FT_VENV:-/tmp/ft-venv}
FT_TORCH=${FT_TORCH:-2.12.0}
FT_CONFIGURE_OPTS=${FT_CONFIGURE_OPTS:-}
CPYTHON_SRC=${CPYTHON_SRC:-}
JOBS=${JOBS:-$(nproc)}
PY=$FT_PREFIX/bin/python3.13t

if [ ! -x "$PY" ]; then
    if [ -z "$CPYTHON_SRC" ] || [ ! -x "$CPYTHON_SRC/configure" ]; then
        echo "ft_env: $PY is missing; set CPYTHON_SRC to a CPython 3.13 source tree" >&2
        exit 2
    fi
    CPYTHON_SRC=$(cd "$CPYTHON_SRC" && pwd)
    build=$(mktemp -d "${TMPDIR:-/tmp}/ft-build.XXXXXX")
    trap 'rm -rf "$build"' EXIT
    start=$SECONDS
    # shellcheck disable=SC2086  # FT_CONFIGURE_OPTS is a list of flags
    (cd "$build" &&
        nice -n 10 "$CPYTHON_SRC/configure" --disable-gil --prefix="$FT_PREFIX" \
            $FT_CONFIGURE_OPTS >configure.log &&
        nice -n 10 make -j"$JOBS" >make.log 2>&1 &&
        nice -n 10 make install >install.log 2>&1) || {
        echo "ft_env: building CPython failed; the logs are in $build" >&2
        trap - EXIT
        exit 1
    }
    echo "ft_env: built $("$PY" -VV | head -1) in $((SECONDS - start)) s"
fi

"$PY" -c 'import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_GIL_DISABLED"))' || {
    echo "ft_env: $PY is not a free-threaded build (configure --disable-gil)" >&2
    exit 1
}

[ -x "$FT_VENV/bin/python" ] || "$PY" -m venv "$FT_VENV"
VPY=$FT_VENV/bin/python
start=$SECONDS
# Wheels only: numpy, pillow, scipy, pyarrow, pandas, hf-xet... have moved on to releases with
# no cp313t wheel, so pip takes their newest that has one (and the datasets and huggingface-hub
# that accept it) rather than compiling a newer sdist. pyyaml has no cp313t wheel at all; its
# sdist builds in seconds.
"$VPY" -m pip install -q --only-binary=:all: --no-binary=pyyaml "torch==$FT_TORCH" numpy pillow \
    psutil cloudpickle "torchdata>=0.10" scipy datasets
"$VPY" -m pip install -q --no-deps -e "$REPO"
echo "ft_env: packages installed in $((SECONDS - start)) s"

# Each module in turn: a C extension that does not declare free-threading support turns the
# GIL back on when imported (with a RuntimeWarning); the first that does is named.
"$VPY" - <<'EOF'
import importlib, sys, warnings
warnings.simplefilter("default")
for name in ("numpy", "PIL.Image", "psutil", "cloudpickle", "torch", "torchdata.nodes",
             "scipy.optimize", "pyarrow", "pandas", "yaml", "datasets", "torchtune_pipe",
             "multiproc"):
    importlib.import_module(name)
    if sys._is_gil_enabled():
        sys.exit(f"ft_env: importing {name} turned the GIL on")
import torch, numpy, PIL, torchtune_pipe
assert not sys._is_gil_enabled()
print(f"ft_env: {sys.version.split()[0]} free-threaded, GIL off after imports; torch "
      f"{torch.__version__}, numpy {numpy.__version__}, Pillow {PIL.__version__}")
EOF
"$VPY" -c "import sys, torch, numpy, PIL, torchtune_pipe; assert not sys._is_gil_enabled()"
echo "ft_env: $VPY ready"
