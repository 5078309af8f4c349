#!/usr/bin/env bash
# LLaMA on BoolQ: fine-tune (LoRA or full SFT), then zero-shot-style BoolQ evaluation, with the
# environment-variable interface of Pax's script of this name:
#   VOCAB_PATH=spm.model TFDS_DATA_DIR=/data/tfds [CHECKPOINT_RESTORE_PATH=DIR] [EVAL_ONLY=1] \
#       bash run_llama_boolq.sh [extra --fdl.X=V flags for both runs...]
# Required: VOCAB_PATH (SentencePiece model) and TFDS_DATA_DIR (holding super_glue/boolq:1.0.2 from
# scripts_gpu/download_boolq.py). Optional, with Pax's defaults: EVAL_ONLY (0), LOG_DIR (llama/ under
# the temp dir), USE_MULTIPROCESS (0; 1 under srun), USE_LORA (0), LORA_RANK (32), LORA_TARGET_LAYERS
# (all), CONFIG (LLaMA7B; a registered name or a dotted path), CHECKPOINT_RESTORE_PATH, USE_REPEATED_LAYER
# (False), ENABLE_TE (0), XLA_PYTHON_CLIENT_MEM_FRACTION (0.85), and every hyperparameter below
# (LEARNING_RATE, LR_SCHEDULE, MAX_STEPS, PERCORE_BATCH_SIZE, MAX_SEQ_LEN, ICI_MESH_SHAPE, DCN_MESH_SHAPE,
# LR_COS_WARMUP, LR_COS_DECAY_START, LR_COS_DECAY_END). TRAIN_TASK (boolq: fine-tune on BoolQ's train split, as
# Pax's LLaMA configs did; text: the experiment's text data).
# eval/boolq_acc goes to $JOB_DIR/metrics.jsonl (EVAL_ONLY=1: to the directory holding the checkpoints).
#
# Differences from Pax's script, on purpose:
# - USE_LORA accepts 1/true/True and 0/false/False. Pax tested for "1" only, so its example .sub file's
#   USE_LORA="False" meant off but USE_LORA="True" also silently meant off.
# - Pax's SFT run passed LR_COS_WARMUP=500 and left LR_COS_DECAY_START at the class value 4001 (stale,
#   past MAX_STEPS=1000): its "cosine" run was warm-up then constant. paxlite derives DECAY_START from
#   the warm-up (501) and the cosine ends at MAX_STEPS unless LR_COS_DECAY_END says otherwise;
#   LR_COS_DECAY_START=4001 reproduces Pax's schedule.
# - CHECKPOINT_RESTORE_PATH is passed as given (paxlite takes a DIR holding checkpoints/, the checkpoints
#   directory itself, or one checkpoint_N); Pax appended /checkpoints. Unset, no flag is passed.
# - EVAL_ONLY=1 without CHECKPOINT_RESTORE_PATH is an error here (Pax crashed on the unset variable).
# - ENABLE_TE=1 runs Transformer Engine layers (docs/transformer_engine.md); paxlite reads the variable.
set -euo pipefail
# shellcheck source=scripts_gpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VOCAB_PATH=${VOCAB_PATH:-}
TFDS_DATA_DIR=${TFDS_DATA_DIR:-}
if [[ -z "$VOCAB_PATH" || -z "$TFDS_DATA_DIR" ]]; then
    echo "Need to set both VOCAB_PATH (a SentencePiece .model) and TFDS_DATA_DIR (holding" \
         "super_glue/boolq:1.0.2 from scripts_gpu/download_boolq.py) for the script." >&2
    exit 1
fi
export VOCAB_PATH TFDS_DATA_DIR

flag() {  # a 0/1/true/false environment value -> true/false, or exit naming the variable
    case "$2" in
        1|true|True|TRUE) echo true ;;
        0|false|False|FALSE|"") echo false ;;
        *) echo "$1=$2: expected 1/true or 0/false" >&2; exit 1 ;;
    esac
}

EVAL_ONLY=$(flag EVAL_ONLY "${EVAL_ONLY:-0}")
USE_LORA=$(flag USE_LORA "${USE_LORA:-0}")
USE_MULTIPROCESS=$(flag USE_MULTIPROCESS "${USE_MULTIPROCESS:-0}")
USE_REPEATED_LAYER=$(flag USE_REPEATED_LAYER "${USE_REPEATED_LAYER:-False}")
ENABLE_TE=${ENABLE_TE:-0}
CONFIG=${CONFIG:-LLaMA7B}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/llama}
CHECKPOINT_RESTORE_PATH=${CHECKPOINT_RESTORE_PATH:-}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
flag ENABLE_TE "$ENABLE_TE" > /dev/null  # 0/1/true/false, checked before anything starts
export ENABLE_TE  # read by paxlite's experiments (experiments/transformer_engine_settings.py)

# Kept from Pax for the NCCL/TE behaviour its results were measured with.
export ENABLE_FP8=0 NCCL_IB_SL=0 NCCL_PROTO=LL128
export NVTE_FWD_LAYERNORM_SM_MARGIN=4 NVTE_BWD_LAYERNORM_SM_MARGIN=4 NVTE_FUSED_ATTN=${NVTE_FUSED_ATTN:-0}
if [[ "$USE_LORA" == true ]]; then paxlite_set_xla_flags --model=llama-lora; else paxlite_set_xla_flags --model=llama; fi

LORA_FLAGS=()
if [[ "$USE_LORA" == true ]]; then
    LORA_RANK=${LORA_RANK:-32}
    LORA_TARGET_LAYERS=${LORA_TARGET_LAYERS:-all}
    LORA_FLAGS=(--fdl.USE_LORA=true "--fdl.LORA_RANK=$LORA_RANK" "--fdl.LORA_TARGET_LAYERS=\"$LORA_TARGET_LAYERS\"")
    # LoRA: one node.
    PERCORE_BATCH_SIZE=${PERCORE_BATCH_SIZE:-2}
    HYPERPARAM_FLAGS=(
        "--fdl.LEARNING_RATE=${LEARNING_RATE:-1e-4}"
        "--fdl.LR_SCHEDULE=\"${LR_SCHEDULE:-constant}\""
        "--fdl.MAX_STEPS=${MAX_STEPS:-600}"
        "--fdl.PERCORE_BATCH_SIZE=$PERCORE_BATCH_SIZE"
        "--fdl.MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}"
        "--fdl.ICI_MESH_SHAPE=${ICI_MESH_SHAPE:-[8,1,1]}"
        "--fdl.DCN_MESH_SHAPE=${DCN_MESH_SHAPE:-[1,1,1]}"
    )
else
    # Full SFT: two nodes of 8 GPUs (DCN [1,2,1]).
    PERCORE_BATCH_SIZE=${PERCORE_BATCH_SIZE:-2}
    MAX_STEPS=${MAX_STEPS:-1000}
    HYPERPARAM_FLAGS=(
        "--fdl.LEARNING_RATE=${LEARNING_RATE:-1e-6}"
        "--fdl.LR_SCHEDULE=\"${LR_SCHEDULE:-linear_rampup_cosine_decay}\""
        "--fdl.MAX_STEPS=$MAX_STEPS"
        "--fdl.LR_COS_WARMUP=${LR_COS_WARMUP:-500}"
        "--fdl.LR_COS_DECAY_END=${LR_COS_DECAY_END:-$MAX_STEPS}"
        "--fdl.PERCORE_BATCH_SIZE=$PERCORE_BATCH_SIZE"
        "--fdl.MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}"
        "--fdl.ICI_MESH_SHAPE=${ICI_MESH_SHAPE:-[1,8,1]}"
        "--fdl.DCN_MESH_SHAPE=${DCN_MESH_SHAPE:-[1,2,1]}"
    )
    if [[ -n "${LR_COS_DECAY_START:-}" ]]; then
        HYPERPARAM_FLAGS+=("--fdl.LR_COS_DECAY_START=$LR_COS_DECAY_START")
    fi
fi

MULTIPROCESS_FLAGS=()
if [[ "$USE_MULTIPROCESS" == true ]]; then
    # One process per node under srun, laid out as run_pile_multinode.sh does.
    : "${SLURM_NTASKS:?USE_MULTIPROCESS=1 needs SLURM (srun): SLURM_NTASKS is not set}"
    MULTIPROCESS_FLAGS=(--multiprocess_gpu "--server_addr=${SLURM_LAUNCH_NODE_IPADDR:?not under srun}:12345"
                        "--num_hosts=$SLURM_NTASKS" "--host_idx=${SLURM_PROCID:?not under srun}")
fi

NAME="llama-${CONFIG##*.}-mbs-${PERCORE_BATCH_SIZE}-te-${ENABLE_TE}-lora-$([[ $USE_LORA == true ]] && echo 1 || echo 0)"
JOB_DIR=$LOG_DIR/$NAME
LOG_PATH=$LOG_DIR/logs/$NAME.txt
mkdir -p "$LOG_DIR/logs"

COMMON_FLAGS=(
    "--tfds_data_dir=$TFDS_DATA_DIR"
    "--fdl_config=$CONFIG"
    "--fdl.EVAL_TASK=\"boolq\""
    "--fdl.USE_REPEATED_LAYER=$USE_REPEATED_LAYER"
    ${LORA_FLAGS[@]+"${LORA_FLAGS[@]}"}
    "${HYPERPARAM_FLAGS[@]}"
    ${MULTIPROCESS_FLAGS[@]+"${MULTIPROCESS_FLAGS[@]}"}
    --alsologtostderr
)

if [[ "$EVAL_ONLY" == false ]]; then
    if [[ -d "$JOB_DIR/checkpoints" ]]; then
        echo "WARNING: \"checkpoints\" directory already exists in $JOB_DIR. Training will resume from this directory."
    fi
    RESTORE_FLAGS=()
    if [[ -n "$CHECKPOINT_RESTORE_PATH" ]]; then
        RESTORE_FLAGS=("--fdl.CHECKPOINT_RESTORE_PATH=\"$CHECKPOINT_RESTORE_PATH\"")
    fi
    mkdir -p "$JOB_DIR"
    # Like Pax's LLaMA configs (BoolQDataset), fine-tune on BoolQ's train split; TRAIN_TASK=text trains on
    # the experiment's text data instead (DATA_DIR / TFDS_DATASET).
    status=0
    paxlite_run "$LOG_PATH" new python -u -m paxlite.main --job_log_dir="$JOB_DIR" "${COMMON_FLAGS[@]}" \
        "--fdl.TRAIN_TASK=\"${TRAIN_TASK:-boolq}\"" \
        ${RESTORE_FLAGS[@]+"${RESTORE_FLAGS[@]}"} "$@" || status=$?
    if [[ "$status" -ne 0 || -n "$PAXLITE_STOP_SIGNAL" ]]; then
        # stopped by a signal (checkpointed: the same command resumes) or failed: no evaluation now
        paxlite_report "$status"
        exit "$status"
    fi
    EVAL_DIR=$JOB_DIR
else
    # --mode=eval scores the latest checkpoint of a job directory: find the one that holds the given path.
    if [[ -z "$CHECKPOINT_RESTORE_PATH" ]]; then
        echo "EVAL_ONLY=1 needs CHECKPOINT_RESTORE_PATH: a directory holding checkpoints/ (or that" \
             "checkpoints directory, or one checkpoint_N in it) to evaluate." >&2
        exit 1
    fi
    RESTORE=${CHECKPOINT_RESTORE_PATH%/}
    if [[ -d "$RESTORE/checkpoints" ]]; then
        EVAL_DIR=$RESTORE
    elif [[ "$(basename "$RESTORE")" == checkpoints && -d "$RESTORE" ]]; then
        EVAL_DIR=$(dirname "$RESTORE")
    elif [[ "$(basename "$RESTORE")" == checkpoint_* && -d "$RESTORE" ]]; then
        EVAL_DIR=$(dirname "$(dirname "$RESTORE")")
        LATEST=$(find "$(dirname "$RESTORE")" -mindepth 1 -maxdepth 1 -name 'checkpoint_*' | sort | tail -n 1)
        if [[ "${LATEST%/}" != "$RESTORE" ]]; then
            echo "CHECKPOINT_RESTORE_PATH=$CHECKPOINT_RESTORE_PATH is not the latest checkpoint in its" \
                 "directory ($LATEST), and --mode=eval scores the latest: move the later ones aside." >&2
            exit 1
        fi
    else
        echo "CHECKPOINT_RESTORE_PATH=$CHECKPOINT_RESTORE_PATH holds no checkpoints/ directory and is" \
             "neither a checkpoints directory nor a checkpoint_N directory." >&2
        exit 1
    fi
fi

paxlite_run "$LOG_PATH" append python -u -m paxlite.main --job_log_dir="$EVAL_DIR" "${COMMON_FLAGS[@]}" \
    --mode=eval "$@"
