"""Sampler/learner logprob mismatch with and without MXFP8 on each side, and the MXFP8 step-time cost.

On the embedded demo model and task. Both sides hold the same weights (the demo model's, rounded to bf16 as a
Fair Cast export would serve them). The *sampler* generates rollouts token by token with a KV cache, in
``--sampler-dtype`` (bf16 by default, as served); the *learner* scores the same tokens with one full forward in
fp32 (the demo's learner); ``--sampler-dtype float32`` makes both sides compute activations in fp32. Each side's linear layers are either plain or MXFP8 (torchao, emulated: e4m3
elements, 32-element blocks, RCEIL E8M0 scales; ``lm_head`` and embeddings stay high precision on both sides).
The table gives mean and max |log π_learner − log μ_sampler| over the sampled tokens, for the four pairings.

The last part times GRPO steps on the demo (Fair Cast on, so the in-process sampler is the bf16 twin) with
``mxfp8=True`` (emulated) vs ``False``, interleaved, median of per-pair ratios. Emulated MXFP8 is *slower* than
bf16 on CPU: it quantizes and dequantizes in PyTorch ops around an ordinary matmul.

    python benchmarks/mxfp8_consistency.py [--prompts 64] [--sampler-dtype {bfloat16,float32}] [--pairs 5]

Last line: ``matched_mxfp8_gap_reduction: <number> (<dtype> sampler), ...`` (mismatched-pair mean gap, the
smaller of the two, divided by the matched MXFP8 pair's; goal >= 10), per sampler compute dtype.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))


def build_sides(sampler_dtype, device="cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    from trl_fp8.demo.model import demo_model_path
    from trl_fp8.mxfp8.convert import MXRecipe, convert_linears

    base = AutoModelForCausalLM.from_pretrained(demo_model_path()).to(device).eval()
    with torch.no_grad():
        for p in base.parameters():  # the served values: bf16, exactly representable in fp32
            p.copy_(p.to(torch.bfloat16).float())
    models = {}
    for side, dtype in (("sampler", sampler_dtype), ("learner", torch.float32)):
        for fmt in ("bf16", "mxfp8"):
            m = copy.deepcopy(base)
            for p in m.parameters():
                p.data = p.data.to(dtype)
            if fmt == "mxfp8":
                convert_linears(m, MXRecipe(rounding="rceil", kernel="emulated"))
            models[side, fmt] = m
    return models


def consistency(models, prompts: int, seed: int, device="cpu", max_new_tokens=12):
    import torch

    from trl_fp8.tasks.arithmetic import make_arithmetic_dataset
    from transformers import AutoTokenizer

    from trl_fp8.demo.model import demo_model_path

    tok = AutoTokenizer.from_pretrained(demo_model_path())
    data = make_arithmetic_dataset(prompts, seed=seed)
    enc = tok([r["prompt"] for r in data], return_tensors="pt", padding=True, padding_side="left").to(device)
    table = {}
    for sampler_fmt in ("bf16", "mxfp8"):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = models["sampler", sampler_fmt].generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id)
        seq = out.sequences
        completion = seq[:, enc["input_ids"].size(1):]
        sampler_logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        sampler_logp = sampler_logp.gather(2, completion.unsqueeze(2)).squeeze(2)
        # tokens up to and including the first EOS (as TRL masks completions)
        is_eos = completion == tok.eos_token_id
        eos_idx = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], 10**9, dtype=torch.long))
        mask = torch.arange(completion.size(1), device=device).unsqueeze(0) <= eos_idx.unsqueeze(1)
        attention = torch.cat([enc["attention_mask"], mask.long()], 1)
        for learner_fmt in ("bf16", "mxfp8"):
            with torch.no_grad():
                logits = models["learner", learner_fmt](input_ids=seq, attention_mask=attention).logits.float()
            p = enc["input_ids"].size(1)
            learner_logp = torch.log_softmax(logits[:, p - 1:-1], -1).gather(2, completion.unsqueeze(2)).squeeze(2)
            gap = (learner_logp - sampler_logp).abs()[mask]
            table[sampler_fmt, learner_fmt] = (gap.mean().item(), gap.max().item(), int(mask.sum()))
    return table


def step_time_ratio(pairs: int, steps: int) -> list[float]:
    from overhead import _step_timer

    import trl_fp8
    from trl_fp8.demo.model import demo_model_path
    from trl_fp8.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    def run(mxfp8: bool, workdir: str) -> float:
        args = trl_fp8.GRPOConfig(
            output_dir=os.path.join(workdir, str(mxfp8)), use_cpu=True, bf16=False, max_steps=steps,
            learning_rate=1e-4, per_device_train_batch_size=64, num_generations=8, max_completion_length=16,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False,
            seed=0, fair_cast="stochastic", sync_checks="off", mxfp8=mxfp8, mxfp8_kernel="emulated",
        )
        timer = _step_timer()
        trainer = trl_fp8.GRPOTrainer(model=demo_model_path(), reward_funcs=[correctness_reward, format_reward],
                                      args=args, train_dataset=make_arithmetic_dataset(2000, seed=0),
                                      callbacks=[timer])
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        trainer.train()
        return statistics.median(timer.times[1:])

    ratios = []
    with tempfile.TemporaryDirectory() as workdir:
        run(False, workdir)  # warm-up
        for i in range(pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            times = {flag: run(flag, workdir) for flag in order}
            ratios.append(times[True] / times[False])
            print(f"pair {i + 1}: bf16 {times[False] * 1e3:.1f} ms/step, MXFP8 (emulated) {times[True] * 1e3:.1f} "
                  f"ms/step, ratio {ratios[-1]:.2f}", file=sys.stderr, flush=True)
    return ratios


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per consistency round")
    parser.add_argument("--rounds", type=int, default=5, help="consistency rounds (different seeds; median)")
    parser.add_argument("--sampler-dtype", default=None, choices=["bfloat16", "float32"],
                        help="the sampler's compute dtype (default: both, fp32 first)")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved step-time pairs (>= 5; 0 skips timing)")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per timed run")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.pairs and args.pairs < 5:
        parser.error("--pairs must be 0 (skip) or >= 5")
    if args.rounds < 5:
        parser.error("--rounds must be >= 5 (the figures are medians)")

    reductions = {}
    for sampler_dtype in ([args.sampler_dtype] if args.sampler_dtype else ["float32", "bfloat16"]):
        models = build_sides(getattr(torch, sampler_dtype), args.device)
        rounds = [consistency(models, args.prompts, seed, args.device) for seed in range(args.rounds)]
        keys = list(rounds[0])
        print(f"\nsampler computes in {sampler_dtype}, learner in float32; median over {args.rounds} rounds of "
              f"{args.prompts} prompts ({rounds[0][keys[0]][2]} tokens in round 1)")
        print(f"{'sampler':>8} | {'learner':>8} | {'mean |Δ logp|':>14} | {'max |Δ logp|':>13}")
        summary = {}
        for key in keys:
            mean = statistics.median(r[key][0] for r in rounds)
            worst = statistics.median(r[key][1] for r in rounds)
            summary[key] = mean
            print(f"{key[0]:>8} | {key[1]:>8} | {mean:>14.5f} | {worst:>13.4f}")
        mismatched = min(summary["bf16", "mxfp8"], summary["mxfp8", "bf16"])
        reductions[sampler_dtype] = mismatched / max(summary["mxfp8", "mxfp8"], 1e-9)
    if args.pairs:
        ratios = step_time_ratio(args.pairs, args.steps)
        print(f"step time, MXFP8 emulated / bf16 (CPU, demo, Fair Cast twin): {statistics.median(ratios):.2f} "
              f"(ratios {', '.join(f'{r:.2f}' for r in ratios)}) — emulated MXFP8 is slower by design")
    print("matched_mxfp8_gap_reduction: " + ", ".join(
        f"{r:.3g} ({d} sampler)" if r < 1e6 else f">1e6 ({d} sampler: matched gap 0)" for d, r in reductions.items()))


if __name__ == "__main__":
    main()
