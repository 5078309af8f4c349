#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU machine (see docs/performance.md for where the numbers go).
#   Synthetic126M: 50 steps, bf16 compute, one GPU, checkpoint saving off -> tokens/s and MFU from metrics.jsonl.
# The device image has jax, flax, optax, orbax-checkpoint and sentencepiece but not fiddle, grain or tensorboardX:
# fetch their wheels (and pytest, pluggy, iniconfig) into .whl/ first (python3.12 manylinux wheels, see the
# device tool's README) and carry .whl.
set -euo pipefail
OUT_DIR=${OUT:-/tmp/paxlite_gpu}
mkdir -p "$OUT_DIR"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__); print(jax.devices())"
} | tee "$OUT_DIR/environment.txt"

JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT_DIR/gpu_tests.log" || true

python3 -m paxlite.main --fdl_config=Synthetic126M \
  '--fdl.ICI_MESH_SHAPE=[1,1,1]' '--fdl.DCN_MESH_SHAPE=[1,1,1]' --fdl.FPROP_DTYPE=bfloat16 \
  --fdl.MAX_STEPS=50 --fdl.SUMMARY_INTERVAL_STEPS=10 --fdl.EVAL_INTERVAL_STEPS=1000 --fdl.EVAL_LOOP_NUM_BATCHES=1 \
  --enable_checkpoint_saving=false --job_log_dir="$OUT_DIR/synthetic126m" --alsologtostderr \
  2>&1 | grep -v 'Involuntary full rematerialization' | tee "$OUT_DIR/synthetic126m.log"
cp "$OUT_DIR/synthetic126m/metrics.jsonl" "$OUT_DIR/synthetic126m_metrics.jsonl"
python3 - "$OUT_DIR/synthetic126m_metrics.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
steady = [l for l in lines if l["step"] > 10]  # the first window holds warm-up steps
tok = sorted(l["tokens_per_s"] for l in steady)[len(steady) // 2]
mfu = sorted(l["mfu"] for l in steady)[len(steady) // 2]
print(f"Synthetic126M 1 GPU bf16: median tokens/s {tok:,.0f}, median MFU {mfu:.1%} over steps 11-50")
PY

# fuji-1B-v3 (AXLearn's 1B: 16 layers, d 2048, 32 heads, 8 kv heads, vocab 131072, tied head) for 50 steps at
# sequence 4096 in bf16 on one GPU: 8 sequences (32,768 tokens) per step, scanned layers, flash attention.
python3 -m paxlite.main --fdl_config=fuji-1B-v3-flash --fdl.SYNTHETIC_DATA=true \
  '--fdl.ICI_MESH_SHAPE=[1,1,1]' '--fdl.DCN_MESH_SHAPE=[1,1,1]' --fdl.FPROP_DTYPE=bfloat16 \
  --fdl.MAX_SEQ_LEN=4096 --fdl.GLOBAL_BATCH_SIZE=8 --fdl.USE_REPEATED_LAYER=true \
  --fdl.MAX_STEPS=50 --fdl.SUMMARY_INTERVAL_STEPS=10 --fdl.EVAL_INTERVAL_STEPS=1000 --fdl.EVAL_LOOP_NUM_BATCHES=1 \
  --enable_checkpoint_saving=false --job_log_dir="$OUT_DIR/fuji1b" --alsologtostderr \
  2>&1 | grep -v 'Involuntary full rematerialization' | tee "$OUT_DIR/fuji1b.log"
cp "$OUT_DIR/fuji1b/metrics.jsonl" "$OUT_DIR/fuji1b_metrics.jsonl"
python3 - "$OUT_DIR/fuji1b_metrics.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
steady = [l for l in lines if l["step"] > 10]
tok = sorted(l["tokens_per_s"] for l in steady)[len(steady) // 2]
mfu = sorted(l["mfu"] for l in steady)[len(steady) // 2]
print(f"fuji-1B-v3 1 GPU bf16 seq 4096: median tokens/s {tok:,.0f}, median MFU {mfu:.1%} over steps 11-50")
PY
