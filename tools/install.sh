#!/usr/bin/env bash
# Installs everything datastates-hist and its tests need, on a fresh Debian machine
# or an existing environment. A torch that is already installed is kept (GPU users
# bring their own); otherwise the CPU build torch==2.13.0 is installed.
#   --mpi   also MPICH, and mpi4py and ADIOS2 built with MPI (tools/install_mpi.sh),
#           for multi-rank checkpointing and its tests (minutes the first time,
#           seconds once the built wheels are cached)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# h5dump, to check that step files are plain HDF5 (a test uses it); a C compiler and
# Python's headers for the C kernel of the digest and the delta codec (setup.py; without them numpy does its work)
PACKAGES=()
command -v h5dump >/dev/null 2>&1 || PACKAGES+=(hdf5-tools)
command -v cc >/dev/null 2>&1 || PACKAGES+=(gcc)
"$PY" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" ||
    PACKAGES+=(python3-dev)
if [ ${#PACKAGES[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q "${PACKAGES[@]}" >/dev/null 2>&1 ||
        (apt-get update -q >/dev/null && apt-get install -y -q "${PACKAGES[@]}" >/dev/null)) ||
        echo "install.sh: could not install ${PACKAGES[*]}" >&2
fi

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
# DeepSpeed (a test extra) ships as source: DS_BUILD_OPS=0 builds none of its C++/CUDA ops
DS_BUILD_OPS=0 "$PY" -m pip install -q -e ".[test]"
if [ "${1:-}" = "--mpi" ]; then
    bash tools/install_mpi.sh
fi
"$PY" -c "import datastates_hist, torch, adios2, h5py; from datastates_hist import digest; print('datastates-hist', datastates_hist.__version__, '| torch', torch.__version__, '| adios2', adios2.__version__, '| h5py', h5py.__version__, '| digest kernel', 'built' if digest._fused else 'NOT built (numpy fallback)')"
