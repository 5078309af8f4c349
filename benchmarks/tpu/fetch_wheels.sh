#!/usr/bin/env bash
# Fetches into .whl-tpu/ (repository root) the wheels an offline TPU host's own package index lacks, as
# Python 3.11 manylinux x86-64 wheels: fiddle, grain, array-record, tensorboardX, zstandard, portpicker and
# lm_eval, with whatever they need that such an index is not known to hold (the large scientific wheels,
# numpy, scipy, pandas, pyarrow, scikit-learn, protobuf, are left to the host's index). A package that PyPI
# ships only as a source archive (sqlitedict, word2number, rouge-score: pure Python) is built into a wheel
# here. Run where pip reaches PyPI:
#   bash benchmarks/tpu/fetch_wheels.sh        (then carry .whl-tpu/ to the TPU host with the checkout)
# On the host, `source benchmarks/tpu/setup_env.sh` installs them beside the host's index (docs/quickstart.md).
# Versions are CI's (constraints.txt) where it names them: under constraints-py311.txt (the image's
# own stack) pip found no lm_eval whose dependencies resolve (ResolutionImpossible, 2026-12-07).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
WANT=(fiddle grain array-record tensorboardX zstandard portpicker lm_eval)
# Left to the host's index (large, and held by it): not carried.
HOST_INDEX="numpy scipy pandas pyarrow scikit-learn protobuf jax jaxlib ml-dtypes"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# pip download with --only-binary stops at the first requirement that has no wheel: build that one (pure
# Python) into a wheel and try again.
for _ in $(seq 10); do
  if out=$("$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
      "${PLATFORMS[@]}" --find-links "$tmp" -c constraints.txt -d "$tmp" "${WANT[@]}" 2>&1); then
    break
  fi
  missing=$(sed -n 's/.*No matching distribution found for \([^ ;<>=!]*\).*/\1/p' <<<"$out" | head -n 1)
  if [ -z "$missing" ]; then echo "$out" >&2; exit 1; fi
  echo "building a wheel of $missing (PyPI has only its source)"
  "$PYTHON" -m pip wheel -q --no-deps -w "$tmp" "$missing"
done
mkdir -p .whl-tpu
rm -f .whl-tpu/*.whl
for wheel in "$tmp"/*.whl; do
  # the distribution name, normalised as PEP 503 does (lower case, runs of -_. as one -)
  name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
  if grep -qw -- "$name" <<<"$HOST_INDEX"; then continue; fi
  cp "$wheel" .whl-tpu/
done
# never committed (a folder that ignores itself), carried to the TPU host by name
echo '*' > .whl-tpu/.gitignore
ls .whl-tpu
du -sh .whl-tpu
