#!/usr/bin/env bash
# The GPU benchmark in one call, at most 8 minutes on one H200; the full log goes to LOG_DIR and the results
# table is printed last (docs/performance.md, "GPU benchmark"):
#   bash benchmarks/gpu/run.sh [LOG_DIR]          LOG_DIR defaults to $OUT, else /tmp/paxlite_gpu
#   bash benchmarks/gpu/run.sh LOG_DIR --cpu --tiny   (every part on the CPU in seconds; extra args go to bench.py)
# The GPU image has jax, flax, optax, orbax-checkpoint, sentencepiece and pytest but not fiddle, grain or
# tensorboardX, and no network: run benchmarks/gpu/fetch_wheels.sh here first and carry .whl.
#
# Budget (seconds on one H200; estimates, not yet measured: bench.py's deadline enforces the total, starting
# no run it could not finish and marking it "skipped: time budget"):
#   wheels + environment                                                    ~15
#   GPU tests (every gpu-marked test, tests/gpu_pass.py, most telling first;
#              the timeout cuts the rest)                                    75
#   matmul ceilings: bf16 and FP8 at 4096^3, 8192^3, 16384^3 (one process)  ~30
#   planned peaks (benchmarks/gpu/peaks.py), beside the matmuls: each case's train step compiled
#     for this GPU model by XLA's GPU compiler, deviceless, in one JAX_PLATFORMS=cpu process; the
#     first run waits for it, at most 60 s after it started (--plan_s)     <= 30 beyond the matmuls
#     (a full-size case took 14-93 s on a 2-core CPU host: expect the first few cases planned)
#   training, each run = start ~10 + compile + 30 steps (stopped before the final eval):
#     Synthetic126M   ~40 x 4 (bf16/fp8 x flash/dot_product)
#     fuji-1B seq 4096 ~90 x 4
#     GLaM126M64E     ~75 x 4      -> ~820 if all twelve ran: the order (bf16, then fp8, with each model's
#                                     usual attention first) keeps the most telling rows inside the deadline
#   table (with planned and measured peak GiB, and measured/planned)        ~1
#   total                                                                 <= 480 (deadline 465 after start)
set -uo pipefail
START=$(date +%s)
LOG_DIR=${1:-${OUT:-/tmp/paxlite_gpu}}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
# the wheels only where the packages are missing (the GPU image); a machine that has them keeps its own
if ! python3 -c "import fiddle, grain, tensorboardX" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
  python3 -c "import jax, jaxlib, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__); print(jax.devices())"
  git log -1 --format='paxlite %h %s' 2>/dev/null || true
} 2>&1 | tee "$LOG_DIR/environment.txt"

case " $* " in
  *" --cpu "*) echo "--cpu: GPU tests not run" ;;
  *) timeout -k 5 80 python3 tests/gpu_pass.py --timeout_s=75 > "$LOG_DIR/gpu_tests.log" 2>&1
     status=$?
     if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then echo "GPU tests: stopped at the 75 s timeout (see gpu_tests.log)"
     else echo "GPU tests: $(tail -n 1 "$LOG_DIR/gpu_tests.log") (exit $status)"; fi ;;
esac

python3 benchmarks/gpu/bench.py --log_dir="$LOG_DIR" --deadline_s=$(( START + 465 )) "$@" 2>&1 | tee "$LOG_DIR/bench.log"
exit "${PIPESTATUS[0]}"
