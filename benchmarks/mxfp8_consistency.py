"""Sampler/learner logprob mismatch for each weight format (bf16 / MXFP8) *and* each activation precision, and the
MXFP8 step-time cost.

On the embedded demo model and task. Both sides hold the same weights (the demo model's, rounded to bf16 as a
Fair Cast export would serve them). Each side's linear layers are either plain or MXFP8 (torchao, emulated: e4m3
elements, 32-element blocks, RCEIL E8M0 scales; ``lm_head`` and embeddings stay high precision on both sides).

Rows: in each round, the *served* sampler (bf16 weights, bf16 parameters and activations) samples one set of
completions token by token with a KV cache (temperature 1). Every pairing below is measured on those SAME tokens:
each sampler variant re-runs the same ``generate`` (KV cache, token by token) forced onto those tokens and its raw
logits are read; each learner variant scores them with one full forward, as TRL's learner does. The gap is mean
(and max) |log π_learner − log μ_sampler| over the completion tokens up to and including the first EOS.

Activation pairings (learner activations vs sampler activations):

    (a) learner fp32            vs sampler bf16 (as served)   -- the CPU / Hopper demo setting
    (b) learner bf16 autocast   vs sampler bf16 (as served)   -- a Blackwell run (``bf16=True``)
    (c) learner fp32            vs sampler fp32               -- matched fp32 activations
    (d) learner bf16            vs sampler bf16               -- the sampler's own bf16 model scores the rows with
                                                                 one full forward: only batch shape / KV cache differ

each with the four weight pairings sampler/learner: bf16/bf16, bf16/MXFP8, MXFP8/bf16, MXFP8/MXFP8. "bf16
autocast" is the fp32 master under ``torch.autocast(bfloat16)`` (matmuls in bf16, norms/softmax as autocast
decides); the sampler "bf16" holds bf16 parameters and computes everything in bf16.

The last part times GRPO steps on the demo (Fair Cast on, so the in-process sampler is the bf16 twin; learner fp32
activations in both arms) with ``mxfp8=True`` (emulated) vs ``False``, interleaved, median of per-pair ratios.
Emulated MXFP8 is *slower* than bf16 on CPU: it quantizes and dequantizes in PyTorch ops around an ordinary matmul.

    python benchmarks/mxfp8_consistency.py [--prompts 64] [--rounds 5] [--pairs 5] [--steps 20] [--quick]
    python benchmarks/mxfp8_consistency.py --model trl-fp8:smollm2 --prompts 16 --pairs 0   # a real model

With ``--model`` (e.g. ``trl-fp8:smollm2``: hidden 576, intermediate 1536, multiples of 32) the same table is
measured on that model's weights, with chat_math prompts through its chat template.

Last line: ``mxfp8_matched_gap_bf16act: <number>`` -- the MXFP8/MXFP8 mean gap under matched bf16 activations
(pairing b), median over rounds; the line before it gives bf16/bf16 under the same activations for comparison.
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

FORMATS = ("bf16", "mxfp8")
# (label, learner activations, sampler activations)
ACT_PAIRINGS = (
    ("a", "fp32", "bf16"),
    ("b", "bf16-autocast", "bf16"),
    ("c", "fp32", "fp32"),
    ("d", "bf16", "bf16"),
)
ACT_NOTES = {"a": "learner fp32 vs sampler bf16: the CPU / Hopper demo setting",
             "b": "learner bf16 autocast vs sampler bf16: a Blackwell bf16=True run",
             "c": "learner fp32 vs sampler fp32: matched fp32 activations",
             "d": "learner = the sampler's own bf16 model (full forward vs KV cache): fully matched bf16"}


DEMO = "trl-fp8:demo-model"


def _prompts(model_id: str, tok, prompts: int, seed: int) -> list[str]:
    """Prompt texts: the arithmetic task on the demo model; chat_math through the chat template on a chat model."""
    if model_id == DEMO:
        from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

        return [r["prompt"] for r in make_arithmetic_dataset(prompts, seed=seed)]
    from trl_fp8.app.tasks.chat_math import make_chat_math_dataset

    return [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in make_chat_math_dataset(prompts, seed=seed)]


def build_models(device="cpu", model_id=DEMO):
    """``{("sampler", fmt, act): model}`` with act in {"bf16", "fp32"} (the parameters' and activations' dtype) and
    ``{("learner", fmt): model}`` (fp32 parameters; bf16 activations come from autocast at scoring time)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_fp8.models import resolve_model
    from trl_fp8.mxfp8.convert import MXRecipe, convert_linears

    base = AutoModelForCausalLM.from_pretrained(resolve_model(model_id), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        for p in base.parameters():  # the served values: bf16, exactly representable in fp32
            p.copy_(p.to(torch.bfloat16).float())
    sides = [("sampler", "bf16", torch.bfloat16), ("sampler", "fp32", torch.float32), ("learner", None, torch.float32)]
    models = {}
    for side, act, dtype in sides:
        for fmt in FORMATS:
            m = copy.deepcopy(base)
            for p in m.parameters():
                p.data = p.data.to(dtype)
            if fmt == "mxfp8":
                convert_linears(m, MXRecipe(rounding="rceil", kernel="emulated"))
            models[(side, fmt, act) if side == "sampler" else (side, fmt)] = m
    return models


def _forced(tokens, prompt_len):
    """A logits processor that makes greedy decoding emit ``tokens`` (one column per step)."""
    import torch
    from transformers import LogitsProcessor

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            t = input_ids.size(1) - prompt_len
            forced = torch.full_like(scores, float("-inf"))
            forced.scatter_(1, tokens[:, t:t + 1], 0.0)
            return forced

    return Force()


def consistency(models, prompts: int, seed: int, device="cpu", max_new_tokens=12, model_id=DEMO):
    """One round: ``{(pairing, sampler_fmt, learner_fmt): (mean gap, max gap, tokens)}`` on one set of rows, plus
    ``"rescore_check"``: max |Δ logit| between the served sampler's sampling run and its forced re-run (0 means
    the forced re-run reproduces the sampler's computation exactly)."""
    import torch
    from transformers import AutoTokenizer, LogitsProcessorList

    from trl_fp8.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model_id))
    texts = _prompts(model_id, tok, prompts, seed)
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left",
              add_special_tokens=model_id == DEMO).to(device)
    p = enc["input_ids"].size(1)
    common = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, output_logits=True,
                  return_dict_in_generate=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = models["sampler", "bf16", "bf16"].generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, **common)
    seq = out.sequences
    completion = seq[:, p:]
    sampled_logits = torch.stack(out.logits, 1).float()
    # tokens up to and including the first EOS (as TRL masks completions)
    is_eos = completion == tok.eos_token_id
    eos_idx = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], 10**9, dtype=torch.long))
    mask = torch.arange(completion.size(1), device=device).unsqueeze(0) <= eos_idx.unsqueeze(1)
    attention = torch.cat([enc["attention_mask"], mask.long()], 1)

    def logp(logits):
        return torch.log_softmax(logits.float(), -1).gather(2, completion.unsqueeze(2)).squeeze(2)

    sampler_logp, rescore_check = {}, None
    for (side, fmt, act), model in ((k, m) for k, m in models.items() if k[0] == "sampler"):
        with torch.no_grad():
            forced = model.generate(**enc, do_sample=False, max_new_tokens=completion.size(1),
                                    min_new_tokens=0, logits_processor=LogitsProcessorList([_forced(completion, p)]),
                                    temperature=None, top_k=None, top_p=None, **common)
        assert torch.equal(forced.sequences, seq), "the forced re-run did not reproduce the sampled rows"
        logits = torch.stack(forced.logits, 1).float()
        if (fmt, act) == ("bf16", "bf16"):
            rescore_check = (logits - sampled_logits)[mask].abs().max().item()
        sampler_logp[fmt, act] = logp(logits)

    learner_logp = {}
    for fmt in FORMATS:
        for act in ("fp32", "bf16-autocast", "bf16"):
            model = models["sampler", fmt, "bf16"] if act == "bf16" else models["learner", fmt]
            with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                                                 enabled=act == "bf16-autocast"):
                logits = model(input_ids=seq, attention_mask=attention).logits
            learner_logp[fmt, act] = logp(logits[:, p - 1:-1])

    table = {}
    for label, l_act, s_act in ACT_PAIRINGS:
        for s_fmt in FORMATS:
            for l_fmt in FORMATS:
                gap = (learner_logp[l_fmt, l_act] - sampler_logp[s_fmt, s_act]).abs()[mask]
                table[label, s_fmt, l_fmt] = (gap.mean().item(), gap.max().item(), int(mask.sum()))
    table["rescore_check"] = rescore_check
    return table


def summarize(rounds):
    """Median over rounds of each pairing's mean and max gap, and the min–max of the mean gap over rounds."""
    out = {}
    for key in (k for k in rounds[0] if k != "rescore_check"):
        means = [r[key][0] for r in rounds]
        out[key] = (statistics.median(means), min(means), max(means), statistics.median(r[key][1] for r in rounds))
    return out


def _g(x: float) -> str:
    return f"{x:.5f}" if x == 0 or abs(x) >= 1e-4 else f"{x:.1e}"


def format_table(summary) -> list[str]:
    lines = [f"{'':3}{'learner act':>14}{'sampler act':>13} | {'sampler W':>9} / {'learner W':<9} | "
             f"{'mean |Δ logp| (median)':>22}{'min–max over rounds':>22} | {'max |Δ logp| (median)':>21}"]
    for label, l_act, s_act in ACT_PAIRINGS:
        lines.append(f"({label}) {ACT_NOTES[label]}")
        for s_fmt in FORMATS:
            for l_fmt in FORMATS:
                med, lo, hi, worst = summary[label, s_fmt, l_fmt]
                lines.append(f"{'':3}{l_act:>14}{s_act:>13} | sampler {s_fmt:>5} / learner {l_fmt:<5} | "
                             f"{_g(med):>22}{f'{_g(lo)}–{_g(hi)}':>22} | {_g(worst):>21}")
    return lines


def step_time_ratio(pairs: int, steps: int) -> list[float]:
    from overhead import _step_timer

    import trl_fp8
    from trl_fp8.app.demo.model import demo_model_path
    from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per consistency round")
    parser.add_argument("--rounds", type=int, default=5, help="consistency rounds (different seeds; median)")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved step-time pairs (>= 5; 0 skips timing)")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per timed run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=DEMO, help="a model id or trl-fp8:smollm2 (its prompts: chat_math)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 12 (demo), 32 (other models)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 prompts, 1 round, no timing (figures not meaningful)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.rounds, args.pairs = 8, 1, 0
    elif args.pairs and args.pairs < 5:
        parser.error("--pairs must be 0 (skip) or >= 5")
    elif args.rounds < 5:
        parser.error("--rounds must be >= 5 (the figures are medians)")

    if args.model != DEMO and args.pairs:
        parser.error("--pairs (the MXFP8 step-time comparison) runs on the demo model only: give --pairs 0")
    new_tokens = args.max_new_tokens or (12 if args.model == DEMO else 32)
    models = build_models(args.device, args.model)
    rounds = [consistency(models, args.prompts, seed, args.device, new_tokens, args.model)
              for seed in range(args.rounds)]
    print(f"model {args.model}, {new_tokens} new tokens per row")
    summary = summarize(rounds)
    tokens = [r["a", "bf16", "bf16"][2] for r in rounds]
    print(f"\nmean/max |log π_learner − log μ_sampler| per token; {args.rounds} rounds × {args.prompts} prompts "
          f"({min(tokens)}–{max(tokens)} completion tokens per round); all pairings on the same rows, sampled by the "
          f"served sampler (bf16 weights, bf16 activations); forced re-run check, max |Δ logit| vs the sampling run: "
          f"{max(r['rescore_check'] for r in rounds):.3g}")
    for line in format_table(summary):
        print(line)
    if args.pairs:
        ratios = step_time_ratio(args.pairs, args.steps)
        print(f"step time, MXFP8 emulated / bf16 weights (CPU, demo, Fair Cast twin, fp32 learner activations in both): "
              f"{statistics.median(ratios):.2f} (ratios {', '.join(f'{r:.2f}' for r in ratios)}) "
              f"— emulated MXFP8 is slower by design")
    matched = {label: summary[label, "mxfp8", "mxfp8"][0] for label, _, _ in ACT_PAIRINGS}
    plain = {label: summary[label, "bf16", "bf16"][0] for label, _, _ in ACT_PAIRINGS}
    for label, l_act, s_act in ACT_PAIRINGS:
        line = (f"({label}) learner {l_act} / sampler {s_act}: MXFP8/MXFP8 gap {_g(matched[label])} vs bf16/bf16 "
                f"gap {_g(plain[label])} (difference {matched[label] - plain[label]:+.2g})")
        if plain[label] > 0:  # a measured nonzero denominator only
            line += f", ratio {matched[label] / plain[label]:.3g}"
        print(line)
    print(f"mxfp8_matched_gap_bf16act: {matched['b']:.5f}")


if __name__ == "__main__":
    main()
