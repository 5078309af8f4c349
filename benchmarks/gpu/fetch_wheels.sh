#!/usr/bin/env bash
# Fetches into .whl/ (repository root) the wheels the GPU machine's image lacks: fiddle, grain, tensorboardX and
# whatever they need that the image does not have, as python3.12 manylinux x86-64 wheels. benchmarks/gpu/run.sh
# installs them there with pip --no-index (the machine has no network). Run here, where pip reaches an index:
#   bash benchmarks/gpu/fetch_wheels.sh        (then carry .whl to the GPU machine with the working tree)
# Versions are those of constraints.txt where it names them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
WANT=(fiddle grain tensorboardX)
# What the GPU image already has (its package list): a wheel of one of these is not carried, so the image's
# own version (numpy, protobuf, jax, ...) is the one that runs.
IMAGE="absl-py attrs certifi chex click cloudpickle etils filelock flatbuffers flax fsspec humanize idna
iniconfig jax jaxlib jinja2 markupsafe ml-dtypes msgpack numpy opt-einsum optax
orbax-checkpoint packaging pluggy protobuf psutil pygments pytest pyyaml regex requests rich scipy sentencepiece
setuptools simplejson six tensorstore toolz treescope typing-extensions urllib3 wheel wrapt zipp"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -c constraints.txt -d "$tmp" "${WANT[@]}"
mkdir -p .whl
rm -f .whl/*.whl
for wheel in "$tmp"/*.whl; do
  # the distribution name, normalised as PEP 503 does (lower case, runs of -_. as one -)
  name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
  if grep -qw -- "$name" <<<"$IMAGE"; then continue; fi
  cp "$wheel" .whl/
done
# never committed (a folder that ignores itself), carried to the GPU machine by name
echo '*' > .whl/.gitignore
ls -l .whl
du -sh .whl
