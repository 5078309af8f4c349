# shellcheck shell=bash
# Shared by the run_*.sh scripts (sourced, not run): the XLA flag presets and the data flag.

# Exports XLA_FLAGS and the preset's other variables (JAX_OPTIMIZATION_LEVEL, XLA_PYTHON_CLIENT_MEM_FRACTION)
# for one per-model preset, as Pax's xla_flags/*.env files did (python -m paxlite.xla_presets --list shows them;
# docs/performance.md, "XLA flag presets"). $1 is --model=PRESET or --experiment=CONFIG (the family's preset);
# XLA_PRESET=NAME in the environment picks another. The user's XLA_FLAGS win flag by flag, a variable the
# user set is kept, and BASE_XLA_FLAGS (Pax's name) replaces the preset's flags. Each flag is spelt as the
# installed jaxlib accepts it (XLA aborts on an unknown flag), so this starts a short probe of JAX on the CPU.
# Every preset is a GPU preset: on a TPU (JAX_PLATFORMS=tpu, TPU_ACCELERATOR_TYPE, /dev/accel<N> or /dev/vfio/<N>;
# paxlite/xla_presets.py has the rule) nothing is exported and one line on stderr says so.
paxlite_set_xla_flags() {
    local which=$1 exports
    if [ -n "${XLA_PRESET:-}" ]; then which="--model=$XLA_PRESET"; fi
    exports=$(python -m paxlite.xla_presets "$which" --format=shell) || {
        echo "Run failed: no XLA flags for $which" >&2
        exit 2
    }
    eval "$exports"
}

# The flag that feeds DATA_DIR ($1) to paxlite.main: a dataset made by `python -m paxlite.data.prepare`
# (it has paxlite_dataset.json) is --fdl.DATA_DIR; anything else is Pax's TFDS directory.
paxlite_data_flag() {
    if [ -f "$1/paxlite_dataset.json" ]; then echo "--fdl.DATA_DIR=$1"; else echo "--tfds_data_dir=$1"; fi
}

# Runs "$@" (python -m paxlite.main ...) with its output also written to the log file $1 (appended with
# $2 = append, else overwritten: $2 = new), and returns its exit status. A SIGTERM or SIGINT this script
# receives is passed on to paxlite, which finishes its step, checkpoints and exits (docs/training.md,
# "Preemption"); the script waits for that instead of dying first (under Slurm, a step whose script has
# exited is killed). tee ignores those signals, so paxlite's last lines still reach the log. A copy paxlite
# receives directly as well (Slurm and a terminal signal every process) counts once.
# Sets PAXLITE_STOP_SIGNAL to the signal's name when one came.
paxlite_run() {
    local log=$1 mode=$2 pid status
    shift 2
    local tee_args=()
    if [ "$mode" = append ]; then tee_args=(-a); fi
    PAXLITE_STOP_SIGNAL=
    "$@" > >(trap '' TERM INT; exec tee "${tee_args[@]}" "$log") 2>&1 &
    pid=$!
    trap 'PAXLITE_STOP_SIGNAL=SIGTERM; kill -TERM "$pid" 2>/dev/null' TERM
    trap 'PAXLITE_STOP_SIGNAL=SIGINT; kill -INT "$pid" 2>/dev/null' INT
    while true; do
        status=0
        wait "$pid" || status=$?
        # a trapped signal ends `wait` early (status > 128) while paxlite is still stopping: wait again
        if ! kill -0 "$pid" 2>/dev/null; then break; fi
    done
    trap - TERM INT
    wait  # tee's last lines
    return "$status"
}

# The line a run_*.sh script ends with, from paxlite's status ($1).
paxlite_report() {
    if [ "$1" -eq 3 ]; then
        echo "Run stopped by a signal without a checkpoint (checkpoint saving is off): a rerun starts over"
    elif [ "$1" -ne 0 ]; then
        echo "Run failed"
    elif [ -n "${PAXLITE_STOP_SIGNAL:-}" ]; then
        echo "Run stopped by $PAXLITE_STOP_SIGNAL after a checkpoint; the same command resumes it"
    else
        echo "Run succeeded!"
    fi
}
