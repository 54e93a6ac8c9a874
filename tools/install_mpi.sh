#!/usr/bin/env bash
# Builds and installs MPI-enabled mpi4py and ADIOS2 against Debian's MPICH, for
# MPI-collective BP5 writes. The PyPI wheels are serial (adios2) or look for
# another MPI library (mpi4py), so both are built from their PyPI sources.
# Built wheels are cached outside the repository, keyed by versions, so a second
# run on the same machine installs in seconds.
#   DH_WHEEL_CACHE  where wheels are kept (default ~/.cache/datastates-hist/wheels)
set -euo pipefail
PY=${PYTHON:-python3}
MPI4PY_VERSION=${MPI4PY_VERSION:-4.1.2}
ADIOS2_VERSION=${ADIOS2_VERSION:-2.12.1.1001}
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
CACHE=${DH_WHEEL_CACHE:-$HOME/.cache/datastates-hist/wheels}/$PYTAG-mpich-mpi4py$MPI4PY_VERSION-adios2$ADIOS2_VERSION
mkdir -p "$CACHE"

if ! command -v mpicc >/dev/null 2>&1; then
    (apt-get install -y -q mpich libmpich-dev >/dev/null 2>&1 ||
        (apt-get update -q >/dev/null && apt-get install -y -q mpich libmpich-dev >/dev/null))
fi

if [ -z "$(ls "$CACHE"/mpi4py-*.whl 2>/dev/null)" ]; then
    echo "install_mpi.sh: building mpi4py $MPI4PY_VERSION against MPICH (about 3 minutes)" >&2
    "$PY" -m pip wheel -q --no-deps --no-cache-dir --no-binary mpi4py "mpi4py==$MPI4PY_VERSION" -w "$CACHE"
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$CACHE"/mpi4py-*.whl

if [ -z "$(ls "$CACHE"/adios2-*.whl 2>/dev/null)" ]; then
    echo "install_mpi.sh: building ADIOS2 $ADIOS2_VERSION with MPI (about 6 minutes)" >&2
    "$PY" -m pip install -q numpy scikit-build-core setuptools_scm cmake ninja
    # adios2 2.12.1's pip build never looks for mpi4py, so with MPI on its wheel would
    # lack the Python bindings: declare the mpi4py target it needs.
    include=$(mktemp --suffix=.cmake)
    cat > "$include" <<CMAKE
if(NOT TARGET Python::mpi4py)
  add_library(Python::mpi4py INTERFACE IMPORTED GLOBAL)
  set_target_properties(Python::mpi4py PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "$("$PY" -c 'import mpi4py; print(mpi4py.get_include())')")
endif()
set(PythonModule_mpi4py_FOUND TRUE)
CMAKE
    "$PY" -m pip wheel -q --no-deps --no-cache-dir --no-binary adios2 --no-build-isolation \
        -C cmake.define.ADIOS2_USE_MPI=ON -C cmake.define.ADIOS2_USE_CURL=OFF \
        -C cmake.define.ADIOS2_USE_OpenSSL=OFF -C cmake.define.CMAKE_PROJECT_INCLUDE="$include" \
        "adios2==$ADIOS2_VERSION" -w "$CACHE"
    rm -f "$include"
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$CACHE"/adios2-*.whl
"$PY" -c "import adios2, mpi4py; assert adios2.is_built_with_mpi, 'adios2 was built without MPI'; print('adios2', adios2.__version__, 'with MPI | mpi4py', mpi4py.__version__)"
