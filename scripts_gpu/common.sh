# shellcheck shell=bash
# Shared by the run_*.sh scripts (sourced, not run): the XLA flag presets and the data flag.

# Exports XLA_FLAGS and the preset's other variables (JAX_OPTIMIZATION_LEVEL, XLA_PYTHON_CLIENT_MEM_FRACTION)
# for one per-model preset, as Pax's xla_flags/*.env files did (python -m paxlite.xla_presets --list shows them;
# docs/performance.md, "XLA flag presets"). $1 is --model=PRESET or --experiment=CONFIG (the family's preset);
# XLA_PRESET=NAME in the environment picks another. The user's XLA_FLAGS win flag by flag, a variable the
# user set is kept, and BASE_XLA_FLAGS (Pax's name) replaces the preset's flags. Each flag is spelt as the
# installed jaxlib accepts it (XLA aborts on an unknown flag), so this starts a short probe of JAX on the CPU.
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
