#!/usr/bin/env bash
# Zero-shot Lambada of a pretrained GPT126M, with Pax's positional arguments:
#   bash run_lambada_singlenode.sh LAMBADA_DIR VOCAB_PATH [PREC=bfloat16] [NUM_GPUS=8] [PERCORE_BATCH_SIZE=4] LOG_DIR [extra flags...]
# LAMBADA_DIR is Pax's TFDS_DATA_DIR (holding my_lambada/1.0.0 from download_lambada.py) or a directory holding
# OpenAI's lambada_test.jsonl; LOG_DIR is the pretraining job directory,
# whose latest checkpoint is evaluated (eval/lambada_acc_strict and eval/log_pplx go to its metrics.jsonl).
set -uo pipefail
# shellcheck source=scripts_gpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

LAMBADA_DIR=${1:?usage: run_lambada_singlenode.sh LAMBADA_DIR VOCAB_PATH [PREC] [NUM_GPUS] [PERCORE_BATCH_SIZE] LOG_DIR}
VOCAB_PATH=${2:?VOCAB_PATH (a SentencePiece model) is required}
PREC=${3:-bfloat16}
NUM_GPUS=${4:-8}
PERCORE_BATCH_SIZE=${5:-4}
LOG_DIR=${6:?LOG_DIR, the pretraining job directory, is required}
shift $(( $# < 6 ? $# : 6 ))

export VOCAB_PATH
if [ -f "$LAMBADA_DIR/lambada_test.jsonl" ]; then LAMBADA_FLAG="--fdl.LAMBADA_PATH=$LAMBADA_DIR/lambada_test.jsonl"
else LAMBADA_FLAG="--tfds_data_dir=$LAMBADA_DIR"; fi
paxlite_set_xla_flags --model=gpt126m

status=0
paxlite_run "$LOG_DIR/lambada_output.log" new python -m paxlite.main \
    --fdl_config=paxlite.experiments.gpt.Lambada126M \
    --fdl.FPROP_DTYPE="\"$PREC\"" \
    --fdl.ICI_MESH_SHAPE="[$NUM_GPUS,1,1]" \
    --fdl.DCN_MESH_SHAPE="[1,1,1]" \
    --fdl.PERCORE_BATCH_SIZE="$PERCORE_BATCH_SIZE" \
    "$LAMBADA_FLAG" \
    --mode=eval \
    --job_log_dir="$LOG_DIR" \
    --alsologtostderr "$@" || status=$?
paxlite_report "$status"
exit "$status"
