#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the device path's tests (tests/test_cuda.py
# and the lazy-snapshot tests) and tools/bench_gpu.py with the tensors stored raw and with
# the default codec. Logs and the benchmarks' JSON go to OUTDIR.
#
#   bash tools/gpu_checks.sh OUTDIR [BENCH_ARGS...]   # e.g. --gb 2 --steps 12 --reps 3
set -u
out=${1:?usage: tools/gpu_checks.sh OUTDIR [BENCH_ARGS...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."

{
    nvidia-smi
    python3 -c "import torch, adios2, h5py, blosc2; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0)); print('adios2', adios2.__version__, 'h5py', h5py.__version__, 'blosc2', blosc2.__version__)"
    echo "cores $(nproc)"; free -g; df -h /dev/shm /var/tmp
} >"$out/env.txt" 2>&1
python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1 || echo "the C kernel did not build: numpy fallbacks (see build.txt)"

timeout 150 python3 -m pytest tests/test_cuda.py tests/test_snapshot.py -q -p no:cacheprovider >"$out/tests.txt" 2>&1
echo "tests: exit $?"; tail -n 3 "$out/tests.txt"

target=/dev/shm  # three checkpoints of the state must fit
[ "$(df --output=avail -B1G /dev/shm | tail -n 1)" -ge 24 ] || target=/var/tmp
for codec in raw delta; do
    timeout 200 python3 tools/bench_gpu.py --target "$target" --codec "$codec" --save "$out/bench_$codec.json" "$@" \
        >"$out/bench_$codec.txt" 2>&1
    echo "bench_gpu.py --codec $codec: exit $?"; cat "$out/bench_$codec.txt"
done
