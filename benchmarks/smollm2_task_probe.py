"""Probe the chat_math task on SmolLM2-135M-Instruct (``trl-fp8:smollm2``) before training on it: per level, the
sampled accuracy (temperature 1, as GRPO samples), the greedy accuracy, how often a completion boxes an answer,
completion lengths and the fraction cut by the cap. Used to pick the level mix and cap whose starting accuracy is
10-40 % with rollouts of varying length.

    python benchmarks/smollm2_task_probe.py [--levels 1,2,3] [--prompts 16] [--samples 4] [--cap 128]
        [--no-system] [--jsonl benchmarks/results/smollm2_task_probe.jsonl]

Last line: ``chat_math_sampled_accuracy: <all levels>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,2,3")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per level")
    parser.add_argument("--samples", type=int, default=4, help="sampled completions per prompt")
    parser.add_argument("--cap", type=int, default=128, help="max new tokens")
    parser.add_argument("--no-system", action="store_true", help="no system prompt")
    parser.add_argument("--style", default="system", help="system | user | fewshot (see trl_fp8.app.tasks.chat_math)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_fp8.models import resolve_model
    from trl_fp8.app.tasks.chat_math import SYSTEM_PROMPT, boxed_format_reward, correctness_reward, make_chat_math_dataset

    torch.manual_seed(args.seed)
    folder = resolve_model("trl-fp8:smollm2")
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    totals = []
    for level in [int(x) for x in args.levels.split(",")]:
        data = make_chat_math_dataset(args.prompts, seed=100 + level, levels=(level,),
                                      system_prompt=None if args.no_system else SYSTEM_PROMPT, style=args.style)
        texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in data["prompt"]]
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        results = {}
        for mode, kwargs in (("greedy", dict(do_sample=False)),
                             ("sampled", dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                              num_return_sequences=args.samples))):
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=args.cap, pad_token_id=tok.pad_token_id, **kwargs)
            new = out[:, batch["input_ids"].shape[1]:]
            n = new.shape[0] // len(texts)
            completions = tok.batch_decode(new, skip_special_tokens=True)
            answers = [a for a in data["answer"] for _ in range(n)]
            lengths = [int((row != tok.pad_token_id).sum()) for row in new]
            correct = correctness_reward(completions, answers)
            boxed = [r > 0 for r in boxed_format_reward(completions)]
            results[mode] = {"accuracy": sum(correct) / len(correct), "boxed": sum(boxed) / len(boxed),
                             "mean_length": statistics.mean(lengths), "capped": sum(x >= args.cap for x in lengths)
                             / len(lengths), "p10_p50_p90": [sorted(lengths)[int(q * (len(lengths) - 1))]
                                                            for q in (0.1, 0.5, 0.9)], "n": len(correct)}
            if mode == "sampled":
                totals += correct
        row = {"level": level, "cap": args.cap, "style": args.style, "system": not args.no_system,
               "seconds": round(time.perf_counter() - start, 1), **results, "example": completions[0][:300]}
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"chat_math_sampled_accuracy: {sum(totals) / len(totals):.3f}")


if __name__ == "__main__":
    main()
