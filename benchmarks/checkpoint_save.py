"""Save time of a trl_fp8 atomic checkpoint (temporary folder, every file and folder fsync'd, completion marker, rename)
over TRL's own checkpoint save (written in place, nothing fsync'd), same trainer, same state.

A Qwen2 built from a config (fp32, AdamW state populated), every trl_fp8 feature off, CPU. Saves alternate (TRL,
trl_fp8, then trl_fp8, TRL, ...) so machine noise and page-cache drift hit both alike; each save writes a new
checkpoint-N (removed after, outside the timing). The figure is the median over pairs of (trl_fp8 / TRL). The disk
and filesystem decide most of it: fsync waits for the device.

    python benchmarks/checkpoint_save.py [--reps 7] [--hidden 512] [--layers 4] [--quick]

Last line: `atomic_save_over_trl: <number>`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(workdir: str, hidden: int, layers: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset
    from trl_fp8.tokenization import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), num_key_value_heads=1,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model_dir = os.path.join(workdir, "model")
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    args = trl_fp8.GRPOConfig(output_dir=os.path.join(workdir, "run"), use_cpu=True, bf16=False, report_to="none",
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                              save_strategy="steps", disable_tqdm=True)
    trainer = trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(8, seed=0))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()  # AdamW state: two fp32 moments per parameter, as in a real checkpoint
    trainer.optimizer.zero_grad()
    return trainer


def checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7, help="pairs of saves (>= 5)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="smoke mode: a tiny model, 5 pairs")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.hidden, a.layers = 5, 64, 2
    if a.reps < 5:
        p.error("--reps must be >= 5")
    if a.hidden < 64 or a.hidden % 64:
        p.error("--hidden must be a positive multiple of 64")
    if a.layers < 1:
        p.error("--layers must be >= 1")

    import torch
    from trl import GRPOTrainer as TRLGRPOTrainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as workdir:
        trainer = build(workdir, a.hidden, a.layers)
        run_dir = trainer.args.output_dir
        saves = {"trl": lambda: TRLGRPOTrainer._save_checkpoint(trainer, trainer.model, None),
                 "trl_fp8": lambda: trainer._save_checkpoint(trainer.model, None)}
        times = {"trl": [], "trl_fp8": []}
        size = None
        step = 0
        for rep in range(a.reps):
            order = ("trl", "trl_fp8") if rep % 2 == 0 else ("trl_fp8", "trl")
            for flavour in order:
                step += 1
                trainer.state.global_step = step
                t0 = time.perf_counter()
                saves[flavour]()
                times[flavour].append(time.perf_counter() - t0)
                folder = os.path.join(run_dir, f"checkpoint-{step}")
                size = size or checkpoint_bytes(folder)
                shutil.rmtree(folder)
        ratios = [f / t for f, t in zip(times["trl_fp8"], times["trl"])]
        print(f"checkpoint size: {size / 2**20:.1f} MiB ({a.layers} layers, hidden {a.hidden}, fp32 + AdamW state)")
        for flavour in ("trl", "trl_fp8"):
            print(f"{flavour:8s} save: median {statistics.median(times[flavour]) * 1e3:.1f} ms "
                  f"(min {min(times[flavour]) * 1e3:.1f}, max {max(times[flavour]) * 1e3:.1f})")
        print(f"per-pair ratios: {', '.join(f'{r:.2f}' for r in ratios)}")
        print(f"atomic_save_over_trl: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
