#!/usr/bin/env bash
# The TPU pass in one call, on a TPU host (the lent v5e machine: offline, Python 3.11, JAX with libtpu):
# the tpu tests on the chip, then the TPU benchmark; the full log goes to LOG_DIR and the results table is
# printed last (docs/performance.md, "TPU benchmark"):
#   bash benchmarks/tpu/run.sh [LOG_DIR] [BENCH_ARGS...]      LOG_DIR defaults to $OUT, else /tmp/paxlite_tpu
#   bash benchmarks/tpu/run.sh LOG_DIR --cpu --tiny            (every part on the CPU in seconds)
# An offline host needs the wheels of benchmarks/tpu/fetch_wheels.sh, fetched where pip reaches PyPI and
# carried as .whl-tpu/; benchmarks/tpu/setup_env.sh installs them beside the host's own index.
# Environment: TPU_TESTS_TIMEOUT_S (default 300) caps the tests, BENCH_BUDGET_S (default 360) the benchmark.
set -uo pipefail
START=$(date +%s)
LOG_DIR=${1:-${OUT:-/tmp/paxlite_tpu}}
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
if ! python3 -c "import fiddle, grain, flax, optax, orbax.checkpoint" 2> /dev/null; then
  # shellcheck source=benchmarks/tpu/setup_env.sh
  source benchmarks/tpu/setup_env.sh || exit 1
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1
{
  date -u
  python3 -c "import sys, jax, jaxlib, flax, optax, orbax.checkpoint as o; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__)"
  git log -1 --format='paxlite %h %s' 2>/dev/null || true
  echo "setup: $(( $(date +%s) - START )) s"
} 2>&1 | tee "$LOG_DIR/environment.txt"

case " $* " in
  *" --cpu "*) echo "--cpu: TPU tests not run" ;;
  *) limit=${TPU_TESTS_TIMEOUT_S:-300}
     timeout -k 5 $(( limit + 5 )) python3 tests/tpu_pass.py --timeout_s="$limit" > "$LOG_DIR/tpu_tests.log" 2>&1
     status=$?
     echo "TPU tests: $(tail -n 1 "$LOG_DIR/tpu_tests.log") (exit $status)" ;;
esac

python3 benchmarks/tpu/bench.py --log_dir="$LOG_DIR" --deadline_s=$(( $(date +%s) + ${BENCH_BUDGET_S:-360} )) "$@" 2>&1 \
  | tee "$LOG_DIR/bench.log"
exit "${PIPESTATUS[0]}"
