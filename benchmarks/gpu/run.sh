#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU machine (see docs/performance.md for where the numbers go).
#   Synthetic126M, fuji-1B-v3, GLaM126M64E and a small Mixtral (both grouped-matmul kernels): 50 steps each, bf16
#   compute, one GPU, checkpoint saving off -> tokens/s and MFU from metrics.jsonl.
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

# One training job: 50 synthetic steps on one GPU, checkpoint saving off; prints the median tokens/s and MFU of
# steps 11-50 (the first window holds warm-up steps). Usage: train_job NAME LABEL --fdl_config=... [--fdl.*=...]
train_job() {
  local name=$1 label=$2
  shift 2
  python3 -m paxlite.main "$@" \
    '--fdl.ICI_MESH_SHAPE=[1,1,1]' '--fdl.DCN_MESH_SHAPE=[1,1,1]' --fdl.FPROP_DTYPE=bfloat16 \
    --fdl.MAX_STEPS=50 --fdl.SUMMARY_INTERVAL_STEPS=10 --fdl.EVAL_INTERVAL_STEPS=1000 --fdl.EVAL_LOOP_NUM_BATCHES=1 \
    --enable_checkpoint_saving=false --job_log_dir="$OUT_DIR/$name" --alsologtostderr \
    2>&1 | grep -v 'Involuntary full rematerialization' | tee "$OUT_DIR/$name.log" || true
  [ -f "$OUT_DIR/$name/metrics.jsonl" ] || { echo "$label: no metrics (see $name.log)"; return 0; }
  cp "$OUT_DIR/$name/metrics.jsonl" "$OUT_DIR/${name}_metrics.jsonl"
  python3 - "$OUT_DIR/${name}_metrics.jsonl" "$label" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
steady = [l for l in lines if l["step"] > 10]
tok = sorted(l["tokens_per_s"] for l in steady)[len(steady) // 2]
mfu = sorted(l["mfu"] for l in steady)[len(steady) // 2]
extra = {k: round(v, 4) for k, v in steady[-1].items() if k.startswith("moe/")}
print(f"{sys.argv[2]}: median tokens/s {tok:,.0f}, median MFU {mfu:.1%} over steps 11-50 {extra or ''}")
PY
}

train_job synthetic126m "Synthetic126M 1 GPU bf16" --fdl_config=Synthetic126M

# fuji-1B-v3 (AXLearn's 1B: 16 layers, d 2048, 32 heads, 8 kv heads, vocab 131072, tied head) at sequence 4096:
# 8 sequences (32,768 tokens) per step, scanned layers, flash attention.
train_job fuji1b "fuji-1B-v3 1 GPU bf16 seq 4096" --fdl_config=fuji-1B-v3-flash --fdl.SYNTHETIC_DATA=true \
  --fdl.MAX_SEQ_LEN=4096 --fdl.GLOBAL_BATCH_SIZE=8 --fdl.USE_REPEATED_LAYER=true

# GLaM 126M/64E (1.9B parameters, 166M active; MFU counts active FLOPs): Pax's per-GPU batch of 4 x 2048, one
# GShard group of 8,192 tokens (capacity 256 per expert).
train_job glam126m64e "GLaM126M64E 1 GPU bf16" --fdl_config=SyntheticGLaM126M64E

# A small Mixtral (4 layers, d 1024, 8 SwiGLU experts of 3584, top-2, seq 2048, 8 sequences) with each
# grouped-matmul kernel: XLA's default ragged_dot lowering against JAX's Pallas-Triton one.
for kernel in ragged_dot pallas_triton; do
  train_job "mixtral_small_$kernel" "small Mixtral 1 GPU bf16, $kernel" --fdl_config=TinyMixtral \
    --fdl.NUM_LAYERS=4 --fdl.MODEL_DIMS=1024 --fdl.HIDDEN_DIMS=3584 --fdl.NUM_HEADS=16 --fdl.NUM_KV_HEADS=4 \
    --fdl.DIMS_PER_HEAD=64 --fdl.VOCAB_SIZE=32000 --fdl.MAX_SEQ_LEN=2048 --fdl.GLOBAL_BATCH_SIZE=8 \
    --fdl.MOE_GROUPED_MATMUL="$kernel"
done
