#!/usr/bin/env bash
# Downloads the wheels that a GPU machine with only Python 3.12, torch, transformers, accelerate, peft, numpy and
# pytest lacks for benchmarks/gpu_check.py, into benchmarks/gpu_wheels/ (git-ignored), and fails past 64 MiB in all.
#
#   bash benchmarks/gpu_wheels.sh            # then copy the repository, wheels included, to the GPU machine
#
# The set: trl and what it imports that those packages do not bring (datasets, pyarrow, pandas and theirs), found as
# the difference of pip's resolutions with and without trl for CPython 3.12 on manylinux x86-64. trl_rpp itself
# imports nothing more (wandb is optional). Each is the oldest release its dependants accept where that is smaller:
# pyarrow 24 (datasets 5.2 needs >= 24) is 6 MiB below the newest. manylinux_2_28: the glibc torch 2.11's wheels need.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=benchmarks/gpu_wheels
LIMIT_BYTES=$((64 * 1024 * 1024))
WHEELS=(
  trl==1.16.0 datasets==5.2.0 pyarrow==24.0.0 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
)
rm -rf "$DEST"
mkdir -p "$DEST"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --dest "$DEST" "${WHEELS[@]}"
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
  exit 1
fi
total=0
for w in "$DEST"/*.whl; do
  size=$(stat -c %s "$w")
  total=$((total + size))
  printf '%9.2f MiB  %s\n' "$(echo "$size / 1048576" | bc -l)" "$(basename "$w")"
done
printf '%9.2f MiB  total (limit 64 MiB)\n' "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "the wheels exceed 64 MiB" >&2
  exit 1
fi
