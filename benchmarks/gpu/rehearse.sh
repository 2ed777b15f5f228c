#!/usr/bin/env bash
# The device run rehearsed here, so that the first run on a lent GPU machine is not its first run: a clean
# environment with the image's versions (benchmarks/gpu/device_image.txt: transformers 5.17, accelerate 1.15, peft,
# huggingface_hub 1.33, ...; torch is the local CPU 2.13.0 build, the one that resolves on this machine), only the
# prepared wheels installed the way run_all.sh installs them there (pip --no-index --no-deps --target), and
# `run_all.sh --smoke` in it with no network: inside a network namespace of its own (`unshare -n`, loopback only:
# the many-process check's torchrun needs 127.0.0.1) where the machine allows one, else with the offline variables
# alone (it says which).
#
#   bash benchmarks/gpu/rehearse.sh [--dir DIR]      # default runs/rehearsal (ignored); .ci/run calls it
#
# The environment (DIR/venv) is kept between runs and rebuilt when device_image.txt changes. The wheels are
# prepared by prepare.sh for this machine's Python into DIR/whl: the same pins as .whl/ (which is for the image's
# Python 3.12); multiprocess, the one wheel tagged per Python, differs. Exit status: run_all.sh's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=$ROOT/runs/rehearsal
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift ;;
    *) echo "usage: bash benchmarks/gpu/rehearse.sh [--dir DIR]" >&2; exit 2 ;;
  esac
  shift
done
HOST_PY=${HOST_PYTHON:-python3}
REQ=$ROOT/benchmarks/gpu/device_image.txt
V=$DIR/venv
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
started=$(date +%s)
want="$(sha256sum "$REQ" | cut -c1-16) torch==2.13.0 $($HOST_PY -c 'import sys; print(sys.version.split()[0])')"
if [ ! -f "$V/.rehearsal" ] || [ "$(cat "$V/.rehearsal")" != "$want" ]; then
  echo "rehearse.sh: building $V (the device image's versions, CPU torch)"
  rm -rf "$V"
  $HOST_PY -m venv "$V"
  # torch first and alone: the local CPU file (a bare `torch` or a range could pull a CUDA build of several GB)
  quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
  quiet "$V/bin/python" -m pip install --quiet torch==2.13.0
  quiet "$V/bin/python" -m pip install --quiet -r "$REQ"
  "$V/bin/python" - <<'PY'
import torch
assert torch.__version__ == "2.13.0+cpu", \
    f"rehearse.sh: the environment's torch is {torch.__version__}, not the local CPU build 2.13.0+cpu"
PY
  echo "$want" >"$V/.rehearsal"
fi
pyv=$("$V/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
bash "$ROOT/benchmarks/gpu/prepare.sh" --dest "$DIR/whl" --python-version "$pyv" --no-size-check
rm -rf "$DIR/site" "$DIR/out"  # as bare as a fresh machine
env_cmd=(env -u PYTHONPATH PYTHON="$V/bin/python" PIP_NO_INDEX=1 HF_HUB_OFFLINE=1)
cmd=(bash "$ROOT/benchmarks/gpu/run_all.sh" --smoke --wheels "$DIR/whl" --site "$DIR/site" --out "$DIR/out")
versions=$("$V/bin/python" -c \
  'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')
if unshare -n sh -c 'ip link set lo up' 2>/dev/null; then
  echo "rehearse.sh: run_all.sh --smoke with no network (unshare -n, loopback only), Python $pyv, $versions"
  set +e
  unshare -n sh -c 'ip link set lo up && exec "$@"' sh "${env_cmd[@]}" "${cmd[@]}"
  rc=$?
else
  echo "rehearse.sh: no network namespace here (unshare -n refused): offline by HF_HUB_OFFLINE/PIP_NO_INDEX alone," \
       "Python $pyv, $versions"
  set +e
  "${env_cmd[@]}" "${cmd[@]}"
  rc=$?
fi
echo "rehearse.sh: exit $rc in $(( $(date +%s) - started )) s (environment, wheels and the smoke run)"
exit $rc
