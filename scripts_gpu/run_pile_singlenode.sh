#!/usr/bin/env bash
# Pile126M on one node, with Pax's positional arguments:
#   bash run_pile_singlenode.sh DATA_DIR VOCAB_PATH [PREC=bfloat16] [NUM_GPUS=8] [PERCORE_BATCH_SIZE=4] [LOG_DIR=test_logdir] [extra flags...]
# DATA_DIR is Pax's TFDS_DATA_DIR (holding the_pile/1.0.0 from download_the_pile.py), or a dataset directory made by
# `python -m paxlite.data.prepare` (recognised by its paxlite_dataset.json).
# Extra flags after the six positional arguments are passed on (e.g. --fdl.MAX_STEPS=1000).
set -uo pipefail
# shellcheck source=scripts_gpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DATA_DIR=${1:?usage: run_pile_singlenode.sh DATA_DIR VOCAB_PATH [PREC] [NUM_GPUS] [PERCORE_BATCH_SIZE] [LOG_DIR]}
VOCAB_PATH=${2:?VOCAB_PATH (a SentencePiece model) is required}
PREC=${3:-bfloat16}
NUM_GPUS=${4:-8}
PERCORE_BATCH_SIZE=${5:-4}
LOG_DIR=${6:-test_logdir}
shift $(( $# < 6 ? $# : 6 ))

export VOCAB_PATH
DATA_FLAG=$(paxlite_data_flag "$DATA_DIR")
paxlite_set_xla_flags --model=gpt126m
mkdir -p "$LOG_DIR"

status=0
paxlite_run "$LOG_DIR/pile_output.log" new python -m paxlite.main \
    --fdl_config=paxlite.experiments.gpt.Pile126M \
    --fdl.FPROP_DTYPE="\"$PREC\"" \
    --fdl.ICI_MESH_SHAPE="[$NUM_GPUS,1,1]" \
    --fdl.DCN_MESH_SHAPE="[1,1,1]" \
    --fdl.PERCORE_BATCH_SIZE="$PERCORE_BATCH_SIZE" \
    "$DATA_FLAG" \
    --job_log_dir="$LOG_DIR" \
    --alsologtostderr "$@" || status=$?
paxlite_report "$status"
exit "$status"
