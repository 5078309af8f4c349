#!/usr/bin/env bash
# Pile126M on several nodes under SLURM (one process per node), with Pax's positional arguments:
#   bash run_pile_multinode.sh DATA_DIR VOCAB_PATH [PREC=bfloat16] [NUM_GPUS=8] [PERCORE_BATCH_SIZE=4] [LOG_DIR=test_logdir] [extra flags...]
# DCN_MESH_SHAPE follows $SLURM_JOB_NUM_NODES; JAX's runtime connects the processes (--multiprocess_gpu).
set -uo pipefail
# shellcheck source=scripts_gpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DATA_DIR=${1:?usage: run_pile_multinode.sh DATA_DIR VOCAB_PATH [PREC] [NUM_GPUS] [PERCORE_BATCH_SIZE] [LOG_DIR]}
VOCAB_PATH=${2:?VOCAB_PATH (a SentencePiece model) is required}
PREC=${3:-bfloat16}
NUM_GPUS=${4:-8}
PERCORE_BATCH_SIZE=${5:-4}
LOG_DIR=${6:-test_logdir}
shift $(( $# < 6 ? $# : 6 ))
: "${SLURM_JOB_NUM_NODES:?run under SLURM (srun), or use run_pile_singlenode.sh}"

export VOCAB_PATH
DATA_FLAG=$(paxlite_data_flag "$DATA_DIR")
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
paxlite_set_xla_flags --model=gpt126m
mkdir -p "$LOG_DIR"

status=0
paxlite_run "$LOG_DIR/pile_output_${SLURM_PROCID}.log" new python -m paxlite.main \
    --fdl_config=paxlite.experiments.gpt.Pile126M \
    --fdl.FPROP_DTYPE="\"$PREC\"" \
    --fdl.ICI_MESH_SHAPE="[$NUM_GPUS,1,1]" \
    --fdl.DCN_MESH_SHAPE="[$SLURM_JOB_NUM_NODES,1,1]" \
    --fdl.PERCORE_BATCH_SIZE="$PERCORE_BATCH_SIZE" \
    "$DATA_FLAG" \
    --job_log_dir="$LOG_DIR" \
    --multiprocess_gpu \
    --server_addr="${SLURM_LAUNCH_NODE_IPADDR}:12345" \
    --num_hosts="$SLURM_NTASKS" \
    --host_idx="$SLURM_PROCID" \
    --alsologtostderr "$@" || status=$?
paxlite_report "$status"
exit "$status"
