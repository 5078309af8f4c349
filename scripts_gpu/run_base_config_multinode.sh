#!/usr/bin/env bash
# Any registered experiment on several nodes under SLURM (one process per node), with Pax's positional
# arguments:
#   bash run_base_config_multinode.sh CONFIG [PREC=bfloat16] [NUM_GPUS=8] [LOG_DIR=test_logdir]
#       [TFDS_DATA_DIR=None] [VOCAB_PATH] [ADDITIONAL_ARGS] [extra flags...]
# CONFIG is a registered name (Synthetic126M, LLaMA7B, ...) or a dotted path. NUM_GPUS is accepted and
# unused, as in Pax (the experiment's ICI_MESH_SHAPE decides). TFDS_DATA_DIR "None" passes no
# --tfds_data_dir. VOCAB_PATH is exported when given; Pax defaulted it to a gs:// T5 vocabulary that
# paxlite cannot read, so here there is no default. ADDITIONAL_ARGS is one string of flags (word-split).
set -uo pipefail
# shellcheck source=scripts_gpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

CONFIG=${1:?usage: run_base_config_multinode.sh CONFIG [PREC] [NUM_GPUS] [LOG_DIR] [TFDS_DATA_DIR] [VOCAB_PATH] [ADDITIONAL_ARGS]}
PREC=${2:-bfloat16}
NUM_GPUS=${3:-8}
LOG_DIR=${4:-test_logdir}
TFDS_DATA_DIR=${5:-None}
VOCAB_PATH=${6:-}
ADDITIONAL_ARGS=${7:-}
shift $(( $# < 7 ? $# : 7 ))
: "${SLURM_JOB_NUM_NODES:?run under SLURM (srun); on one machine call python -m paxlite.main directly}"

if [ -n "$VOCAB_PATH" ]; then export VOCAB_PATH; fi
# ADDITIONAL_ARGS -> one argument per whitespace-separated word, as Pax's unquoted expansion split it.
read -r -d '' -a ADDITIONAL_FLAGS <<< "$ADDITIONAL_ARGS" || true  # -d '': status 1 at end of input
TFDS_FLAGS=()
if [ "$TFDS_DATA_DIR" != "None" ]; then TFDS_FLAGS=("--tfds_data_dir=$TFDS_DATA_DIR"); fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
paxlite_set_xla_flags --experiment="$CONFIG"
mkdir -p "$LOG_DIR"

status=0
paxlite_run "$LOG_DIR/output_${SLURM_PROCID}.log" new python -u -m paxlite.main \
    --job_log_dir="$LOG_DIR" \
    --fdl_config="$CONFIG" \
    --fdl.FPROP_DTYPE="\"$PREC\"" \
    --multiprocess_gpu \
    --server_addr="${SLURM_LAUNCH_NODE_IPADDR}:12345" \
    --num_hosts="$SLURM_NTASKS" \
    --host_idx="$SLURM_PROCID" \
    ${TFDS_FLAGS[@]+"${TFDS_FLAGS[@]}"} \
    --alsologtostderr ${ADDITIONAL_FLAGS[@]+"${ADDITIONAL_FLAGS[@]}"} "$@" || status=$?
paxlite_report "$status"
exit "$status"
