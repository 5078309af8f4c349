# shellcheck shell=bash
# Makes paxlite runnable on an offline TPU host whose image has Python 3.11, JAX with libtpu and a local
# package index (the machine lent for development: /opt/pypi/simple). Source it from the repository root:
#   source benchmarks/tpu/setup_env.sh
# It installs, into SITE (default /tmp/paxlite-site; nothing system-wide, no root), the packages paxlite
# needs from the host's index and from the wheels benchmarks/tpu/fetch_wheels.sh put in .whl-tpu/ (for what
# the index lacks), and appends SITE and the checkout to PYTHONPATH: the image's own JAX stays first on the
# path, so a JAX that pip brings along as a dependency is never the one imported. An installed SITE is kept
# (a stamp file); remove it to install again.
PAXLITE_TPU_INDEX=${PAXLITE_TPU_INDEX:-file:///opt/pypi/simple}
PAXLITE_TPU_SITE=${PAXLITE_TPU_SITE:-/tmp/paxlite-site}
_paxlite_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
_paxlite_need=(flax optax orbax-checkpoint absl-py sentencepiece tensorstore numpy fiddle grain array-record
  tensorboardX zstandard portpicker lm_eval safetensors)
if [ ! -f "$PAXLITE_TPU_SITE/.installed" ]; then
  _paxlite_links=()
  if compgen -G "$_paxlite_root/.whl-tpu/*.whl" > /dev/null; then
    _paxlite_links=(--find-links "$_paxlite_root/.whl-tpu")
  fi
  # --isolated and PIP_CONFIG_FILE=/dev/null: the host's pip settings cannot point this at a network index
  if PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-compile --no-cache-dir \
      --disable-pip-version-check --only-binary=:all: --index-url "$PAXLITE_TPU_INDEX" "${_paxlite_links[@]}" \
      --target "$PAXLITE_TPU_SITE" "${_paxlite_need[@]}"; then
    touch "$PAXLITE_TPU_SITE/.installed"
  else
    echo "paxlite: installing paxlite's dependencies from $PAXLITE_TPU_INDEX and .whl-tpu/ failed (above);" \
      "run benchmarks/tpu/fetch_wheels.sh where pip reaches PyPI and carry .whl-tpu/" >&2
    # sourced: return to the caller's shell; run as a script: exit
    # shellcheck disable=SC2317
    return 1 2> /dev/null || exit 1
  fi
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PAXLITE_TPU_SITE:$_paxlite_root"
unset _paxlite_root _paxlite_need _paxlite_links
