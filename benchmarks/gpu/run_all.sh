#!/usr/bin/env bash
# Every device check in one run, with one JSON summary: on a GPU machine in one lease, or as a CPU smoke run.
#
#   bash benchmarks/gpu/run_all.sh [--smoke] [--out DIR]
#
# Runs mxfp8_check.py, qlora_check.py, many_processes_check.py and smollm2_check.py (GRPO steps on SmolLM2-135M in
# bf16 with Fair Cast and the weight-sync checks), each under its own time limit, logs each to DIR/<check>.log and
# writes DIR/summary.json: per check its exit status, seconds and last line. --smoke runs each script's CPU smoke
# mode (tiny sizes, what CI runs so the script cannot rot). Sized to finish within 8 minutes on one H200 (the four
# limits add up to 7.5 minutes); not yet timed on one. Exit status 1 when any check failed.
set -uo pipefail
SMOKE=0
OUT=benchmarks/results/gpu
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT=$2; shift ;;
    *) echo "usage: bash benchmarks/gpu/run_all.sh [--smoke] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/status.tsv"
run() {  # name, time limit (s), script, args...
  local name=$1 limit=$2 script=$3
  shift 3
  local start rc
  start=$(date +%s)
  timeout "$limit" "$PY" "$HERE/$script" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >>"$OUT/status.tsv"
  echo "$name: exit $rc" >&2
}
if [ "$SMOKE" = 1 ]; then
  run mxfp8 300 mxfp8_check.py --device cpu --quick
  run qlora 300 qlora_check.py --device cpu --quick
  # two processes on a small CPU machine: one thread each (two torch workloads must not oversubscribe the cores)
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 run many_processes 300 many_processes_check.py --device cpu --quick
  run smollm2 300 smollm2_check.py --device cpu --quick
else
  run mxfp8 120 mxfp8_check.py
  run qlora 120 qlora_check.py
  run many_processes 90 many_processes_check.py
  run smollm2 120 smollm2_check.py
fi
"$PY" - "$OUT" "$SMOKE" <<'PY'
import json, os, sys
out, smoke = sys.argv[1], sys.argv[2] == "1"
checks = {}
for line in open(os.path.join(out, "status.tsv")):
    name, rc, seconds = line.rstrip("\n").split("\t")
    lines = [l for l in open(os.path.join(out, f"{name}.log"), errors="replace").read().splitlines() if l.strip()]
    checks[name] = {"exit": int(rc), "seconds": int(seconds), "last_line": lines[-1] if lines else ""}
summary = {"smoke": smoke, "checks": checks, "passed": all(c["exit"] == 0 for c in checks.values())}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary, indent=1))
sys.exit(0 if summary["passed"] else 1)
PY
