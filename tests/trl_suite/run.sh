#!/usr/bin/env bash
# TRL's own GRPO test-suite (tests/test_grpo_trainer.py, "not slow"), run offline against trl_fp8.
#
#   tests/trl_suite/run.sh TRL_REPO OUTDIR [MODE] [-k EXPR]     (or: make trl-suite TRL_REPO=... [MODE=...])
#
# TRL_REPO: a checkout of TRL's repository, or its bare git directory (HEAD's tests/ are used). MODE:
#   trl       plain TRL (the reference pass set)
#   defaults  trl.GRPOTrainer/GRPOConfig replaced by trl_fp8's, every trl_fp8 field at its default
#   features  the same with fair_cast="stochastic" and sync_checks="all" forced on (the default)
#   hidden    fair_cast="error_feedback", duet=True with duet_budget=0.5 and sync_checks="all" forced on
#   passrate  hidden with duet_allocator="pass_rate" (DUET's pass-rate allocator)
# The tiny trl-internal-testing models and the zen dataset the tests download are fabricated locally (build_hub.py);
# nothing reaches the Hub. Writes OUTDIR/pytest.log, OUTDIR/junit.xml, OUTDIR/passed.txt; with MODE != trl and a
# reference pass set at OUTDIR/../trl/passed.txt, also OUTDIR/regressions.txt (passed on TRL, not here).
# Not part of `make test` (it needs TRL's repository); about 5 minutes on 2 cores; run nothing else meanwhile.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,15p' "$0"
  exit 2
fi
REPO=$1 OUT=$2 MODE=${3:-features}
shift $(( $# >= 3 ? 3 : 2 ))
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
case "$MODE" in trl|defaults|features|hidden|passrate) ;; *) echo "MODE must be trl, defaults, features, hidden or passrate, got '$MODE'" >&2; exit 2;; esac
[ -x "$PY" ] || { echo "no python at $PY: run 'make install' first, or set PYTHON" >&2; exit 2; }
git -C "$REPO" rev-parse --verify -q HEAD >/dev/null || { echo "$REPO is not a git checkout of TRL's repository" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/suite"
mkdir -p "$OUT/suite"
git -C "$REPO" archive HEAD tests | tar -x -C "$OUT/suite"
# TRL's own pytest settings (markers, warning filters) and a rootdir at the suite: test ids do not depend on OUT, and
# the settings of a project OUT lies in (ours, with the default OUT under runs/) do not leak into TRL's tests.
CONFIG="$OUT/suite/pytest.ini"
if git -C "$REPO" show HEAD:pyproject.toml 2>/dev/null | grep -q '^\[tool\.pytest\.ini_options\]'; then
  CONFIG="$OUT/suite/pyproject.toml"
  git -C "$REPO" show HEAD:pyproject.toml >"$CONFIG"
else
  printf '[pytest]\n' >"$CONFIG"
fi
"$PY" "$HERE/patch_testing_utils.py" "$OUT/suite/tests/testing_utils.py"
export HF_HOME="$OUT/../hf_home" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
[ -f "$HF_HOME/.trl_fp8_hub_built" ] || "$PY" "$HERE/build_hub.py" "$HF_HOME"
cd "$OUT/suite"
status=0
TRL_FP8_SUITE_MODE=$MODE PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -c "$CONFIG" --rootdir "$OUT/suite" -p suite_plugin \
  tests/test_grpo_trainer.py -m "not slow" -q -p no:cacheprovider --junitxml="$OUT/junit.xml" "$@" \
  >"$OUT/pytest.log" 2>&1 || status=$?
"$PY" "$HERE/passed.py" "$OUT/junit.xml" >"$OUT/passed.txt"
echo "$MODE: $(tail -n 1 "$OUT/pytest.log") (pytest exit $status); $(wc -l <"$OUT/passed.txt") passed -> $OUT/passed.txt"
REF="$OUT/../trl/passed.txt"
if [ "$MODE" != trl ] && [ -f "$REF" ]; then
  comm -23 <(sort "$REF") <(sort "$OUT/passed.txt") >"$OUT/regressions.txt"
  echo "passed on TRL but not with trl_fp8 ($MODE): $(wc -l <"$OUT/regressions.txt") -> $OUT/regressions.txt"
  cat "$OUT/regressions.txt"
fi
