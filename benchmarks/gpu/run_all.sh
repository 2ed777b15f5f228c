#!/usr/bin/env bash
# Every device check in one run, with one JSON summary: on the lent GPU machine in one lease, or as a CPU smoke run.
#
#   bash benchmarks/gpu/run_all.sh [--smoke] [--wheels DIR] [--site DIR] [--out DIR]
#
# Runs mxfp8_check.py, qlora_check.py, many_processes_check.py, smollm2_check.py (GRPO steps on SmolLM2-135M in
# bf16 with Fair Cast and the weight-sync checks) and memory_check.py (the memory plan against max_memory_allocated,
# which also writes OUT/memory_check.jsonl), each under its own time limit, logs each to OUT/<check>.log and
# writes OUT/summary.json: per check its exit status, seconds, whether its limit stopped it and its last line; the
# versions it ran with (benchmarks/gpu/carry.py env) and the wheel install. --smoke runs each script's CPU smoke mode
# (tiny sizes, what CI runs so the script cannot rot). Exit status 1 when any check failed.
#
# On the lent machine (no network; see docs/benchmarks.md for the exact device call): `bash benchmarks/gpu/prepare.sh`
# here first, then `--wheels .whl` there installs the carried wheels with pip --no-index --no-deps --target SITE
# (default /tmp/site) and puts SITE on PYTHONPATH; the SmolLM2 check then builds its model from DIR/smollm2-135m
# (random weights: the real ones cannot travel). PYTHON (default python3, the image's) runs everything; OUT defaults
# to $OUT when the environment sets it (the device tool does), else benchmarks/results/gpu. The whole run stays under
# 8 minutes: checks run against one deadline (DEADLINE_S, 450 s after the start; --smoke: 1800), each under
# min(its limit, time left), and one with under 20 s left is not started (summary: "skipped"). Each check is told
# its limit in CHECK_LIMIT_S (memory_check.py starts only the set-ups that fit in it). Every PROGRESS_S (10) seconds
# a running check's elapsed time and last log line go to stderr and OUT/progress.log.
set -uo pipefail
SMOKE=0
OUT_DIR=${OUT:-benchmarks/results/gpu}
WHEELS=
SITE=/tmp/site
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT_DIR=$2; shift ;;
    --wheels) WHEELS=$2; shift ;;
    --site) SITE=$2; shift ;;
    *) echo "usage: bash benchmarks/gpu/run_all.sh [--smoke] [--wheels DIR] [--site DIR] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3}
START=$(date +%s)
if [ "$SMOKE" = 1 ]; then DEADLINE_S=${DEADLINE_S:-1800}; else DEADLINE_S=${DEADLINE_S:-450}; fi
PROGRESS_S=${PROGRESS_S:-10}
DEADLINE=$(( START + DEADLINE_S ))
mkdir -p "$OUT_DIR"
: >"$OUT_DIR/progress.log"
STATUS=$(mktemp)
INSTALL_LOG=$(mktemp)
trap 'rm -f "$STATUS" "$INSTALL_LOG"' EXIT
# Nothing reaches a network here: the Hub, the datasets hub, W&B and pip are told so.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PIP_NO_INDEX=1
export PYTHONUNBUFFERED=1  # a check stopped by its limit still leaves what it printed in its log
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # trl_fp8 from this tree (no install needed)
install_rc=-1
install_s=0
ARCH_ARGS=()
if [ -n "$WHEELS" ]; then
  t=$(date +%s)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl >"$INSTALL_LOG" 2>&1
  install_rc=$?
  install_s=$(( $(date +%s) - t ))
  echo "install of $WHEELS/*.whl into $SITE: exit $install_rc ($install_s s)" >&2
  [ "$install_rc" = 0 ] || cat "$INSTALL_LOG" >&2
  export PYTHONPATH=$ROOT:$SITE${PYTHONPATH#"$ROOT"}
  if [ -d "$WHEELS/smollm2-135m" ]; then ARCH_ARGS=(--arch-dir "$WHEELS/smollm2-135m"); fi
fi
run() {  # name, time limit (s), script, args...
  local name=$1 limit=$2 script=$3
  shift 3
  local start rc left
  start=$(date +%s)
  left=$(( DEADLINE - start ))
  if [ "$left" -lt 20 ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" -1 0 "$limit" >>"$STATUS"
    echo "not run: the run's deadline (DEADLINE_S) was $left s away" >"$OUT_DIR/$name.log"
    echo "$name: skipped (deadline)" >&2
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  CHECK_LIMIT_S=$limit timeout -k 10 "$limit" "$PY" "$HERE/$script" "$@" >"$OUT_DIR/$name.log" 2>&1 &
  local pid=$! next=$(( start + PROGRESS_S ))
  # a progress line every PROGRESS_S seconds (stderr and OUT/progress.log): how far the check is and its last line,
  # so that a run stopped from outside still shows where its time went
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ "$(date +%s)" -ge "$next" ] && kill -0 "$pid" 2>/dev/null; then
      # the last line as a terminal shows it: what follows its last carriage return (progress bars redraw with \r)
      echo "$name: $(( $(date +%s) - start )) s of $limit; last line: $(tail -n 1 "$OUT_DIR/$name.log" \
        | awk -F'\r' '{print $NF}' | cut -c1-200)" \
        | tee -a "$OUT_DIR/progress.log" >&2
      next=$(( next + PROGRESS_S ))
    fi
  done
  wait "$pid"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" >>"$STATUS"
  echo "$name: exit $rc" >&2
}
# One line per check: name, time limit (s), script, arguments. The first four device limits add up to 6.5 minutes;
# the memory check comes last with up to 90 s of what the 450 s deadline leaves (at least 20 s, else it is skipped),
# and runs as many of its set-ups as fit in the limit it is given.
if [ "$SMOKE" = 1 ]; then
  run mxfp8 300 mxfp8_check.py --device cpu --quick
  run qlora 300 qlora_check.py --device cpu --quick
  # two processes on a small CPU machine: one thread each (two torch workloads must not oversubscribe the cores)
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 run many_processes 300 many_processes_check.py --device cpu --quick
  run smollm2 300 smollm2_check.py --device cpu --quick "${ARCH_ARGS[@]}"
  run memory 300 memory_check.py --device cpu --quick --out "$OUT_DIR" "${ARCH_ARGS[@]}"
else
  run mxfp8 90 mxfp8_check.py
  run qlora 110 qlora_check.py --steps 2
  run many_processes 80 many_processes_check.py
  run smollm2 110 smollm2_check.py "${ARCH_ARGS[@]}"
  run memory 90 memory_check.py --out "$OUT_DIR" "${ARCH_ARGS[@]}"
fi
"$PY" "$HERE/carry.py" env >"$STATUS.env" 2>&1 || true
"$PY" - "$OUT_DIR" "$SMOKE" "$STATUS" "$install_rc" "$install_s" "$INSTALL_LOG" "$WHEELS" "$START" <<'PY'
import json, os, sys, time
out, smoke, status, install_rc, install_s, install_log, wheels, start = sys.argv[1:]
checks = {}
for line in open(status):
    name, rc, seconds, limit = line.rstrip("\n").split("\t")
    lines = [l for l in open(os.path.join(out, f"{name}.log"), errors="replace").read().splitlines() if l.strip()]
    checks[name] = {"exit": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                    "stopped_by_limit": int(rc) in (124, 137), "skipped": int(rc) == -1,
                    "last_line": lines[-1] if lines else ""}
try:
    environment = json.loads(open(status + ".env").read().strip().splitlines()[-1])
except (ValueError, IndexError):
    environment = {"error": open(status + ".env").read()[-2000:]}
os.remove(status + ".env")
install = None
if wheels:
    install = {"wheels": sorted(f for f in os.listdir(wheels) if f.endswith(".whl")) if os.path.isdir(wheels) else [],
               "exit": int(install_rc), "seconds": int(install_s)}
    if install["exit"] != 0:
        install["log_tail"] = open(install_log, errors="replace").read()[-2000:]
summary = {"smoke": smoke == "1", "checks": checks,
           "passed": (install is None or install["exit"] == 0) and all(c["exit"] == 0 for c in checks.values()),
           "seconds_total": int(time.time()) - int(start), "install": install, "environment": environment}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary, indent=1))
sys.exit(0 if summary["passed"] else 1)
PY
