#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the device path's tests (tests/test_cuda.py
# and the lazy-snapshot tests), then tools/bench_gpu.py in four configurations: a checkpoint
# every 12 steps with ADIOS2 raw, HDF5 raw and ADIOS2 with the default codec, then every
# step with ADIOS2 raw. The tables go to standard output; OUTDIR gets checks.txt (the
# machine, the build, the tests) and each benchmark's JSON. Exits 1 if anything failed.
#
#   bash tools/gpu_checks.sh OUTDIR [BENCH_ARGS...]   # e.g. --gb 2 --steps 24 --reps 2
#
# BENCH_ARGS go to every benchmark; leave --every, --backend, --codec and --save to the
# script. With --gb 2 on an H200 a configuration takes 1-3 minutes (every step: the flush
# sets the pace); each is stopped after 240 s.
set -u
out=${1:?usage: tools/gpu_checks.sh OUTDIR [BENCH_ARGS...]}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "$0")/.."
failed=0

{
    nvidia-smi
    python3 -c "import torch, adios2, h5py, blosc2; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0)); print('adios2', adios2.__version__, 'h5py', h5py.__version__, 'blosc2', blosc2.__version__)"
    echo "cores $(nproc)"; free -g; df -h /dev/shm /var/tmp
} >"$out/checks.txt" 2>&1
python3 setup.py -q build_ext --inplace >>"$out/checks.txt" 2>&1 || echo "the C kernel did not build: numpy fallbacks (see checks.txt)"

timeout 150 python3 -m pytest tests/test_cuda.py tests/test_snapshot.py -q -rs -p no:cacheprovider >>"$out/checks.txt" 2>&1
status=$?
echo "tests: exit $status"; tail -n 3 "$out/checks.txt"
[ "$status" -eq 0 ] || failed=1

# bench_gpu.py itself refuses a --target without room for three checkpoints: /dev/shm
# unless it has less room than /var/tmp
target=/dev/shm
[ "$(df --output=avail -B1 /dev/shm | tail -n 1)" -ge "$(df --output=avail -B1 /var/tmp | tail -n 1)" ] || target=/var/tmp
for config in "adios2 raw 12" "hdf5 raw 12" "adios2 delta 12" "adios2 raw 1"; do
    set -- $config "$@"
    backend=$1 codec=$2 every=$3
    shift 3
    name="bench_${backend}_${codec}_every$every"
    timeout 240 python3 tools/bench_gpu.py --target "$target" --backend "$backend" --codec "$codec" \
        --every "$every" --save "$out/$name.json" "$@" 2>&1
    status=$?
    echo "$name: exit $status"
    [ "$status" -eq 0 ] || failed=1
done
exit $failed
