# shellcheck shell=bash
# Shared by the run_*.sh scripts (sourced, not run): Pax's default XLA flags and the data flag.

# XLA_FLAGS = BASE_XLA_FLAGS (Pax's defaults unless set) + the user's XLA_FLAGS. $1 is the all-reduce
# combine threshold in bytes: Pax's scripts use 33554432 for GPT-126M and 51200 elsewhere.
paxlite_set_xla_flags() {
    local all_reduce_bytes=$1
    BASE_XLA_FLAGS=${BASE_XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_highest_priority_async_stream=true --xla_gpu_all_reduce_combine_threshold_bytes=$all_reduce_bytes --xla_gpu_enable_command_buffer=}
    export XLA_FLAGS="${BASE_XLA_FLAGS} ${XLA_FLAGS:-}"
}

# The flag that feeds DATA_DIR ($1) to paxlite.main: a dataset made by `python -m paxlite.data.prepare`
# (it has paxlite_dataset.json) is --fdl.DATA_DIR; anything else is Pax's TFDS directory.
paxlite_data_flag() {
    if [ -f "$1/paxlite_dataset.json" ]; then echo "--fdl.DATA_DIR=$1"; else echo "--tfds_data_dir=$1"; fi
}
