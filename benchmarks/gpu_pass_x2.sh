#!/usr/bin/env bash
# Two GPUs, one device call (kind nvidia-h200-x2), everything inside a deadline (default 575 s):
#   GPU 0: guard overhead first, alone (host-bound µs; SKIP_OVERHEAD=1 skips it), then the given GPU-0 steps;
#   GPU 1: after the overhead run, the given GPU-1 steps.
# Usage: bash benchmarks/gpu_pass_x2.sh "failed opsfull" "decode8b decode"
set -u
start=$(date +%s)
deadline=$((start + ${DEADLINE_S:-575}))
left() { echo $((deadline - $(date +%s))); }
# Each GPU's processes on their own half of the cores: the tests' compiles on GPU 0 do not slow GPU 1's
# host-bound measurements (start-up, serving, piecewise steps).
half=$(($(nproc) / 2))
cpus0="0-$((half - 1))"; cpus1="$half-$((2 * half - 1))"
export OUT=${OUT:-/tmp/out}
if ls wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl
fi
[ -n "${SKIP_OVERHEAD:-}" ] || CUDA_VISIBLE_DEVICES=0 R=/tmp/r_gpu0 TAR=gpu0.tgz bash benchmarks/gpu_pass.sh overhead
(
  for step in $2; do
    CUDA_VISIBLE_DEVICES=1 R=/tmp/r_gpu1 TAR=gpu1.tgz DECODE_TIMEOUT=$(($(left) - 5)) DECODE_STARTUP=${DECODE_STARTUP_1---startup} \
      taskset -c "$cpus1" bash benchmarks/gpu_pass.sh "$step"
    [ "$(left)" -gt 120 ] || break
  done
) > /tmp/gpu1.out 2>&1 &
pid=$!
for step in $1; do
  CUDA_VISIBLE_DEVICES=0 R=/tmp/r_gpu0 TAR=gpu0.tgz OPS_TIMEOUT=$(($(left) - 5)) TESTS_TIMEOUT=$(($(left) - 5)) DECODE_TIMEOUT=$(($(left) - 5)) \
    TEST_WORKERS=${TEST_WORKERS:-12} taskset -c "$cpus0" bash benchmarks/gpu_pass.sh "$step"
done
wait $pid
cat /tmp/gpu1.out
