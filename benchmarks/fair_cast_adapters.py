"""Does Fair Cast still matter when only LoRA adapters are served? (issue 29, item 5)

SmolLM2-135M-Instruct (``trl-fp8:smollm2``: its weights on the bf16 grid, as the real release is), PEFT LoRA r = 16,
``lora_alpha`` 32 (scaling 2), all linear layers, no dropout; the LoRA factors are fp32 masters trained by AdamW
(constant lr, no weight decay, gradient norm clipped at 1.0 as TRL does) under bf16 autocast (``torch.autocast("cpu",
torch.bfloat16)``, what ``bf16=True`` runs on CPU). The adapters are served with trl_fp8's own adapter serving
(``lora_serving="adapters"``: :func:`trl_fp8.fair_cast.peft.adapter_units` in a
:class:`trl_fp8.fair_cast.served.ServedCopy`): the base as loaded, ``Â = export(A)``, ``B̂ = export(s·B)``, the loss
computed on the served factors and the update applied to the fp32 masters (straight-through) -- per export rule
``rtn`` (what serving without Fair Cast does), ``stochastic`` (SR) and ``error_feedback`` (EF).

**Replay, not generation.** To fit the CPU budget the optimizer is driven by a fixed GRPO loss on rollouts generated
once, before training, by the served base (the bf16 model, sampled at t = 1, ``chat_math`` few-shot prompts,
completions <= 96 tokens): ``--prompts`` prompts x ``--generations`` completions, rewards as the demo task
(correctness + 0.2 × boxed format), advantages normalized per prompt group (TRL's ``scale_rewards="group"``);
groups whose rewards are all equal carry no gradient and are left out. Each step takes one group (a per-seed
permutation of the groups, cycled); the loss is TRL's GRPO loss with one iteration per generation (the ratio to the
old policy is 1, so the gradient is ``A · ∇ log p`` per completion token), token-mean over the step's completions
(``loss_type="dapo"``), no KL term (TRL's default ``beta = 0``). So the export rule changes where the gradient is
taken (on the served factors) and what is served; it does not change which rollouts are trained on (a stale sampler
would also generate stale rollouts: not modelled here).

Per step, over *every* adapter element (not a sample):

- ``visible``: fraction of served adapter elements whose bf16 value changed at this export (also per factor: A, B);
- ``reach``: the fraction of the step's master update that reaches the served copy, ``<Δq, Δw> / |Δw|²`` (w: the
  exported fp32 master, ``s·B`` for B; q: the served factor); 1 = all of it, 0 = none;
- ``lag``: how many steps the served copy is behind the master, Fair Cast's ``lag_steps`` (``benchmarks/
  fair_cast_lag.py``): ``<w - q, ū> / |ū|²``, ū the bias-corrected EMA (0.9) of the master's per-step update;
- ``delta_reach``: the same in function space: ``<ΔS, ΔD> / |ΔD|²`` summed over layers, ``D = s·B·A`` the master's
  low-rank delta and ``S = B̂·Â`` the served one (what the served policy adds to each base weight);
- merged serving under RTN (on the ``rtn`` runs' master trajectory; the base W is on the bf16 grid): the fraction of
  the step's ΔD that survives ``RN_bf16(W + D)``: ``merged_reach = <ΔM, ΔD> / |ΔD|²`` with ``M = RN(W + D)``,
  ``merged_changed`` = elements of M that changed / elements of ΔD that are not 0, and the cumulative
  ``merged_total = <M - W, D> / |D|²`` (how much of the adapters' whole delta the merged copy carries), beside the
  adapters' ``adapter_total = <S, D> / |D|²``.

Held-out (the served policy, at step 0, half way and at the end): teacher-forced on 64 ``chat_math`` problems not in
the replay: the mean log-probability per token of the reference completion (``"a + b = c. The answer is
\\boxed{c}."`` and the end-of-turn token, the worked example's format) and the fraction of problems whose answer
tokens (both occurrences of ``c``) are all the argmax.

Runs: for each lr (default 1e-5 and 1e-4), each seed (default 0 1 2; the seed sets the LoRA init, the group order
and SR's stream, shared by the three rules: paired), each rule. Every step's record is appended to ``--jsonl`` as it
happens; a run is the unit of work: a finished run is skipped on restart, an unfinished one is redone (its earlier
records are discarded by the ``start`` record, ``benchmarks/_runlog.py``). The replay is generated once and cached
(``--rollouts``).

    python benchmarks/fair_cast_adapters.py --time-step          # one step per rule: size the run from it
    python benchmarks/fair_cast_adapters.py --steps 24           # all runs (resumable: rerun after a stop)
    python benchmarks/fair_cast_adapters.py --report             # tables from the JSONL, into --report-file too

The report's last line is the headline: ``merged_rtn_share_of_adapter_update_at_<lr>``, the share of each step's
``ΔD`` that a merged RTN copy serves (adapters serve all of it, whatever the rule; the line before gives each rule's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _runlog  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
JSONL = os.path.join(HERE, "results", "fair_cast_adapters_smollm2.jsonl")
ROLLOUTS = os.path.join(HERE, "results", "fair_cast_adapters_rollouts.json")
REPORT = os.path.join(HERE, "results", "fair_cast_adapters_smollm2.txt")
MODES = ("rtn", "stochastic", "error_feedback")
KEYS = ("bench", "model", "lr", "seed", "mode", "steps")
BENCH, BENCH_A_GRID = "fair_cast_adapters", "fair_cast_adapters_a_on_grid"
R, ALPHA = 16, 32
HELDOUT, HELDOUT_SEED = 64, 987
REPLAY_SEED = 0
LAG_EMA = 0.9


def threads_one() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def load_policy(seed: int, a_on_grid: bool = False):
    """The base (fp32 storage, values on the bf16 grid) with fresh LoRA factors (init seeded), and the tokenizer.
    ``a_on_grid``: the A factors' init rounded to bf16 (what Fair Cast's fp32 masters start from when TRL creates
    QLoRA factors in bf16, or an adapter saved in bf16 is loaded)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_fp8.models import SMOLLM2, resolve_model

    folder = resolve_model(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0))
    if a_on_grid:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_A." in name:
                    p.copy_(p.bfloat16().float())
    return model, tokenizer


# -- the replay ----------------------------------------------------------------------------------------------------
def make_rollouts(path: str, prompts: int, generations: int, max_tokens: int = 96) -> dict:
    """Rollouts of the served base (bf16), generated once and cached in ``path`` (JSON)."""
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
        if (data["prompts"], data["generations"]) == (prompts, generations):
            return data
        raise SystemExit(f"{path} holds {data['prompts']} x {data['generations']} rollouts, not {prompts} x "
                         f"{generations}: remove it or pass the same --prompts/--generations")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset
    from trl_fp8.models import SMOLLM2, resolve_model

    folder = resolve_model(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()  # the served base
    data = make_chat_math_dataset(prompts, seed=REPLAY_SEED)
    torch.manual_seed(REPLAY_SEED)
    groups, t0 = [], time.perf_counter()
    tokenizer.padding_side = "left"
    for row in data:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        enc = tokenizer([text] * generations, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, pad_token_id=tokenizer.pad_token_id)
        prompt_ids = enc["input_ids"][0].tolist()
        completions = []
        for seq in out[:, enc["input_ids"].shape[1]:].tolist():
            if tokenizer.eos_token_id in seq:  # keep the end-of-turn token, as TRL does; what follows is padding
                seq = seq[:seq.index(tokenizer.eos_token_id) + 1]
            completions.append(seq)
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = [c + 0.2 * f for c, f in zip(correctness_reward(texts, [row["answer"]] * generations),
                                               boxed_format_reward(texts))]
        mean, std = statistics.mean(rewards), statistics.pstdev(rewards)
        groups.append({"question": row["prompt"][-1]["content"], "answer": row["answer"], "prompt": prompt_ids,
                       "completions": completions, "rewards": rewards,
                       "advantages": [(r - mean) / (std + 1e-4) for r in rewards]})
    data = {"prompts": prompts, "generations": generations, "max_tokens": max_tokens,
            "policy": "the served base (bf16), t = 1", "seconds": round(time.perf_counter() - t0, 1), "groups": groups}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
    return data


def batch_of(group: dict, pad_id: int):
    """Left-padded prompt + right-padded completions of one group: ids, attention mask, completion mask, advantages."""
    import torch

    comps = group["completions"]
    width = max(len(c) for c in comps)
    prompt = group["prompt"]
    ids = torch.full((len(comps), len(prompt) + width), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    cmask = torch.zeros((len(comps), width))
    for i, c in enumerate(comps):
        ids[i, :len(prompt)] = torch.tensor(prompt)
        ids[i, len(prompt):len(prompt) + len(c)] = torch.tensor(c)
        att[i, :len(prompt) + len(c)] = 1
        cmask[i, :len(c)] = 1
    return ids, att, cmask, torch.tensor(group["advantages"], dtype=torch.float32)


def completion_logps(model, ids, att, width: int):
    """Per-token log-probabilities of the last ``width`` tokens (the completions), TRL's way (logits_to_keep)."""
    import torch

    logits = model(input_ids=ids, attention_mask=att, logits_to_keep=width + 1).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, -width:].unsqueeze(-1)).squeeze(-1)


# -- held-out, teacher-forced --------------------------------------------------------------------------------------
def heldout_set(tokenizer, exclude: set[str]):
    """Problems not in the replay: token ids of prompt + reference completion, the completion's span and the token
    positions of the answer."""
    from trl_fp8.app.tasks.chat_math import make_chat_math_dataset

    rows = [r for r in make_chat_math_dataset(HELDOUT * 2, seed=HELDOUT_SEED)
            if r["prompt"][-1]["content"] not in exclude][:HELDOUT]
    items = []
    for r in rows:
        a, op, b = re.match(r"What is (\d+) ([+-]) (\d+)\?", r["prompt"][-1]["content"]).groups()
        ans = r["answer"]
        reference = f"{a} {op} {b} = {ans}. The answer is \\boxed{{{ans}}}."
        prompt = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(r["prompt"] + [{"role": "assistant", "content": reference}],
                                             tokenize=False)
        full = full[:full.index(reference) + len(reference)] + "<|im_end|>"
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        start = len(prompt)
        spans = [(start + m.start(), start + m.end()) for m in re.finditer(re.escape(f"= {ans}."), reference)]
        spans = [(s + 2, e - 1) for s, e in spans] + [(start + reference.index("{" + ans + "}") + 1,
                                                       start + reference.index("{" + ans + "}") + 1 + len(ans))]
        first = next(i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > start)
        answer_pos = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if any(s < b2 and e > a2 for a2, b2 in spans)]
        items.append({"ids": enc["input_ids"], "first": first, "answer": answer_pos})
    return items


def heldout(model, items, pad_id: int, batch: int = 16) -> dict:
    import torch

    total_lp, total_tok, correct = 0.0, 0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for s in range(0, len(items), batch):
            chunk = items[s:s + batch]
            width = max(len(it["ids"]) for it in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            att = torch.zeros_like(ids)
            for i, it in enumerate(chunk):
                ids[i, :len(it["ids"])] = torch.tensor(it["ids"])
                att[i, :len(it["ids"])] = 1
            logits = model(input_ids=ids, attention_mask=att).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            for i, it in enumerate(chunk):
                target = torch.tensor(it["ids"][1:])
                lp = logp[i, :len(target)].gather(-1, target.unsqueeze(-1)).squeeze(-1)
                total_lp += lp[it["first"] - 1:].sum().item()
                total_tok += len(target) - (it["first"] - 1)
                pos = torch.tensor(it["answer"]) - 1
                correct += int(bool((logp[i, pos].argmax(-1) == target[pos]).all()))
    return {"heldout_logp": total_lp / total_tok, "heldout_answer_acc": correct / len(items)}


# -- measurements --------------------------------------------------------------------------------------------------
def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


class Tracker:
    """Per-step figures over every adapter element (see the module docstring)."""

    def __init__(self, copy, layers, merged: bool):
        self.copy, self.layers, self.merged = copy, layers, merged
        self.names = list(copy.units)
        self.ema, self.ema_steps = None, 0
        self.snap()

    def _flat(self, which: str, factor: str | None = None):
        import torch

        parts = []
        for n in self.names:
            if factor is not None and f".lora_{factor}." not in n:
                continue
            t = self.copy.units[n].master if which == "w" else self.copy.served[n]
            parts.append(t.detach().reshape(-1).float())
        return torch.cat(parts)

    def _factors(self):
        """Per LoRA layer: (W, master A, master s·B, served Â, served B̂) (clones of the small ones)."""
        out = []
        for name, layer in self.layers:
            a, b = f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight"
            ua, ub = self.copy.units[a], self.copy.units[b]
            out.append((layer.get_base_layer().weight, ua.master.detach().clone(), ub.master.detach().clone(),
                        self.copy.served[a].float(), self.copy.served[b].float()))
        return out

    def snap(self):
        self.w = self._flat("w")
        self.q = self._flat("q")
        self.wa, self.qa, self.wb, self.qb = (self._flat("w", "A"), self._flat("q", "A"), self._flat("w", "B"),
                                              self._flat("q", "B"))
        self.fac = self._factors()

    def step(self) -> dict:
        import torch

        prev = (self.w, self.q, self.wa, self.qa, self.wb, self.qb, self.fac)
        self.snap()
        w0, q0, wa0, qa0, wb0, qb0, fac0 = prev
        out = {"visible": (self.q != q0).float().mean().item(),
               "visible_A": (self.qa != qa0).float().mean().item(),
               "visible_B": (self.qb != qb0).float().mean().item()}
        for tag, (w_, q_, w0_, q0_) in {"": (self.w, self.q, w0, q0), "_A": (self.wa, self.qa, wa0, qa0),
                                        "_B": (self.wb, self.qb, wb0, qb0)}.items():
            dw = (w_ - w0_).double()
            n2 = dw.pow(2).sum().item()
            out["reach" + tag] = (torch.dot((q_ - q0_).double(), dw).item() / n2) if n2 > 0 else None
        update = self.w - w0
        self.ema = update if self.ema is None else LAG_EMA * self.ema + (1 - LAG_EMA) * update
        self.ema_steps += 1
        direction = (self.ema / (1 - LAG_EMA ** self.ema_steps)).double()
        n2 = direction.pow(2).sum().item()
        out["lag"] = torch.dot((self.w - self.q).double(), direction).item() / n2 if n2 > 0 else None
        # function space: D = s·B·A (master), S = B̂·Â (served); merged: M = RN(W + D)
        sums = dict.fromkeys(("dd", "ds", "DD", "SD", "mm", "MD", "chg", "nz"), 0.0)
        with torch.no_grad():
            for (W, a1, b1, qa1, qb1), (_, a0, b0, qa0_, qb0_) in zip(self.fac, fac0):
                d1, d0 = b1 @ a1, b0 @ a0
                s1, s0 = qb1 @ qa1, qb0_ @ qa0_
                dd = (d1 - d0).double()
                sums["dd"] += dd.pow(2).sum().item()
                sums["ds"] += torch.dot((s1 - s0).double().reshape(-1), dd.reshape(-1)).item()
                sums["DD"] += d1.double().pow(2).sum().item()
                sums["SD"] += torch.dot(s1.double().reshape(-1), d1.double().reshape(-1)).item()
                if self.merged:
                    m1 = (W + d1).bfloat16().float()
                    m0 = (W + d0).bfloat16().float()
                    sums["mm"] += torch.dot((m1 - m0).double().reshape(-1), dd.reshape(-1)).item()
                    sums["MD"] += torch.dot((m1 - W).double().reshape(-1), d1.double().reshape(-1)).item()
                    sums["chg"] += (m1 != m0).sum().item()
                    sums["nz"] += (dd != 0).sum().item()
        ratio = (lambda num, den: num / den if den > 0 else None)
        out["delta_reach"] = ratio(sums["ds"], sums["dd"])
        out["adapter_total"] = ratio(sums["SD"], sums["DD"])
        if self.merged:
            out["merged_reach"] = ratio(sums["mm"], sums["dd"])
            out["merged_total"] = ratio(sums["MD"], sums["DD"])
            out["merged_changed"] = ratio(sums["chg"], sums["nz"])
        return out


def run(lr: float, seed: int, mode: str, steps: int, rollouts: dict, jsonl: str, time_only: bool = False,
        a_on_grid: bool = False) -> float:
    """One run (see the module docstring); returns the median seconds of its optimizer steps."""
    import torch

    from trl_fp8.fair_cast.peft import adapter_units
    from trl_fp8.fair_cast.served import ServedCopy

    key = {"bench": BENCH_A_GRID if a_on_grid else BENCH, "model": "trl-fp8:smollm2", "lr": lr, "seed": seed,
           "mode": mode, "steps": steps}
    if not time_only and _runlog.is_done(jsonl, key):
        return float("nan")
    threads_one()
    model, tokenizer = load_policy(seed, a_on_grid)
    model.train()
    items = heldout_set(tokenizer, {g["question"] for g in rollouts["groups"]})
    groups = [g for g in rollouts["groups"] if statistics.pstdev(g["rewards"]) > 0]
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    copy = ServedCopy(adapter_units(model), mode, torch.bfloat16, seed=seed)
    params = [u.param for u in copy.units.values()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    copy.begin(0)
    tracker = Tracker(copy, lora_layers(model), merged=(mode == "rtn"))
    log = (lambda rec: None) if time_only else (lambda rec: _runlog.append(jsonl, {**key, **rec}))
    log({"kind": "start", "from_step": 0, "time": time.time(), "groups": len(groups)})
    evals = sorted({0, steps // 2, steps})
    if not time_only:
        model.eval()
        log({"kind": "eval", "step": 0, **heldout(model, items, tokenizer.pad_token_id)})
        model.train()
    seconds = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        ids, att, cmask, adv = batch_of(groups[order[(step - 1) % len(order)]], tokenizer.pad_token_id)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = completion_logps(model, ids, att, cmask.shape[1])
        # GRPO, one iteration per generation: ratio exp(logp - logp.detach()) = 1, gradient A·∇logp; token mean
        ratio = torch.exp(logp - logp.detach())
        loss = -((ratio * adv.unsqueeze(1)) * cmask).sum() / cmask.sum()
        loss.backward()
        copy.before_step()  # the masters take the gradients taken on the served factors
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        subset = copy.after_step(step)  # export with the rule; the factors hold the served values again
        train_s = time.perf_counter() - t0
        seconds.append(train_s)
        t1 = time.perf_counter()
        figures = tracker.step()
        rec = {"kind": "step", "step": step, "seconds": round(train_s, 3), "metric_seconds":
               round(time.perf_counter() - t1, 3), "loss": loss.item(), "grad_norm": grad_norm,
               "subset_lag_steps": subset.get("lag_steps"), "subset_visible": subset.get("visible_update_frac"),
               **figures}
        log(rec)
        if time_only:
            print(f"{mode} lr {lr:g} step {step}: train {train_s:.1f} s, metrics {rec['metric_seconds']:.1f} s, "
                  f"{ids.shape[0]} x {ids.shape[1]} tokens, loss {rec['loss']:+.4f}, visible {figures['visible']:.4f}")
        if step in evals and not time_only:
            t2 = time.perf_counter()
            model.eval()
            log({"kind": "eval", "step": step, **heldout(model, items, tokenizer.pad_token_id),
                 "eval_seconds": round(time.perf_counter() - t2, 1)})
            model.train()
    if not time_only:
        log({"kind": "done", "time": time.time()})
    return statistics.median(seconds)


# -- report --------------------------------------------------------------------------------------------------------
def _m(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def report(jsonl: str, out_path: str) -> None:
    runs = [r for r in _runlog.load_runs(jsonl, KEYS).values() if r["done"]]
    if not runs:
        raise SystemExit(f"{jsonl}: no finished run yet")
    lines = []
    say = lines.append
    spread = _runlog.spread
    sets = sorted({(r["key"]["bench"], r["key"]["lr"]) for r in runs}, key=lambda bl: (bl[0] != BENCH, bl[1]))
    step_s = sorted(x["seconds"] for r in runs for x in r["steps"].values())
    say("SmolLM2-135M-Instruct (trl-fp8:smollm2, base on the bf16 grid), LoRA r=16 alpha=32 (scaling 2) all linear, "
        "fp32 adapter masters, bf16 autocast (CPU, AVX-512 BF16), AdamW constant lr, grad-norm clip 1.0; adapters "
        "served as base + exported factors (lora_serving='adapters'); GRPO loss on replayed rollouts of the base (one "
        "prompt x 8 completions per step); figures over every adapter element; per rule mean ± std [min, max] over "
        f"seeds of each run's mean over its steps; median optimizer step {statistics.median(step_s):.1f} s (one "
        "core, shared machine)")
    headline = {}
    for bench, lr in sets:
        at = {m: sorted((r for r in runs if (r["key"]["bench"], r["key"]["lr"]) == (bench, lr)
                         and r["key"]["mode"] == m), key=lambda r: r["key"]["seed"]) for m in MODES}
        seeds = sorted({r["key"]["seed"] for rs in at.values() for r in rs})
        steps = max(r["key"]["steps"] for rs in at.values() for r in rs)
        init = ("A factors start on the bf16 grid (as TRL's bf16 QLoRA factors upcast to fp32 masters)"
                if bench == BENCH_A_GRID else "A factors start as PEFT initialises them (fp32 Kaiming-uniform, off "
                "the bf16 grid)")
        say(f"\n## lr {lr:g}, {init}: {steps} steps, seeds {seeds}\n")
        say("| rule | seeds | served adapter elements changed per step (A / B) | share of the step's master update reaching "
            "the served factors (A / B) | share of the step's ΔD = s·B·A reaching the served B̂Â | lag (steps), "
            "mean \\|lag\\| / signed, last 5 steps |")
        say("|---|---|---|---|---|---|")
        for mode in MODES:
            rs = at[mode]
            if not rs:
                continue

            def per_run(field, last=None):
                vals = []
                for r in rs:
                    xs = [r["steps"][s].get(field) for s in sorted(r["steps"])]
                    xs = [x for x in xs if x is not None]
                    xs = xs[-last:] if last else xs
                    if xs:
                        vals.append(statistics.mean(xs))
                return vals

            def per_run_abs(field):
                return [statistics.mean(abs(x) for x in xs) for xs in
                        ([r["steps"][s][field] for s in sorted(r["steps"]) if r["steps"][s].get(field) is not None]
                         for r in rs) if xs]

            say(f"| {mode} | {len(rs)} | {spread(per_run('visible'), '.4f')} ({_fmt(_m(per_run('visible_A')), '.4f')} / "
                f"{_fmt(_m(per_run('visible_B')), '.4f')}) | {spread(per_run('reach'), '.4f')} "
                f"({_fmt(_m(per_run('reach_A')), '.4f')} / {_fmt(_m(per_run('reach_B')), '.4f')}) | "
                f"{spread(per_run('delta_reach'), '.4f')} | {spread(per_run_abs('lag'), '.3f')} / "
                f"{spread(per_run('lag', 5), '+.3f')} |")
            headline[(bench, lr, mode)] = (_m(per_run("reach")), _m(per_run("delta_reach")),
                                           _m(per_run("reach_A")))
        say("")
        say("| rule | seeds | held-out logp/token at step " + " / ".join(str(s) for s in _evals(at)) +
            " | answer accuracy (teacher-forced) at the same steps | logp change, first to last eval |")
        say("|---|---|---|---|---|")
        for mode in MODES:
            rs = at[mode]
            if not rs:
                continue
            ev = _evals(at)
            lp = " / ".join(_fmt(_m([r["evals"].get(s, {}).get("heldout_logp") for r in rs]), ".4f") for s in ev)
            acc = " / ".join(_fmt(_m([r["evals"].get(s, {}).get("heldout_answer_acc") for r in rs]), ".3f")
                             for s in ev)
            d = [r["evals"][max(r["evals"])]["heldout_logp"] - r["evals"][0]["heldout_logp"] for r in rs]
            say(f"| {mode} | {len(rs)} | {lp} | {acc} | {spread(d, '+.4f')} |")
        for other in ("stochastic", "error_feedback"):
            pairs = [(a, b) for a in at["rtn"] for b in at[other] if a["key"]["seed"] == b["key"]["seed"]
                     and a["evals"] and b["evals"]]
            if pairs:
                last = max(pairs[0][0]["evals"])
                d = [b["evals"][last]["heldout_logp"] - a["evals"][last]["heldout_logp"] for a, b in pairs]
                dacc = [b["evals"][last]["heldout_answer_acc"] - a["evals"][last]["heldout_answer_acc"]
                        for a, b in pairs]
                say(f"\n{other} − rtn at step {last}, paired per seed: held-out logp/token "
                    f"{', '.join(f'{x:+.4f}' for x in d)} ({spread(d, '+.4f')}); answer accuracy "
                    f"{', '.join(f'{x:+.3f}' for x in dacc)}")
        rtn = at["rtn"]
        if rtn and bench == BENCH:
            def col(field):
                return [statistics.mean(xs) for xs in ([r["steps"][s][field] for s in sorted(r["steps"])
                                                        if r["steps"][s].get(field) is not None] for r in rtn) if xs]

            def last_val(field):
                return [r["steps"][max(r["steps"])].get(field) for r in rtn
                        if r["steps"][max(r["steps"])].get(field) is not None]

            say(f"\nMerged vs adapter serving under RTN (lr {lr:g}, the rtn runs' masters): share of the step's ΔD "
                f"reaching the served policy: merged RN(W + D) {spread(col('merged_reach'), '.3f')} (elements of M "
                f"changed / elements of ΔD ≠ 0: {spread(col('merged_changed'), '.4f')}); adapters B̂Â "
                f"{spread(col('delta_reach'), '.3f')}. Of the adapters' whole delta D after the last step, the merged "
                f"copy carries {spread(last_val('merged_total'), '.3f')}, the served adapters "
                f"{spread(last_val('adapter_total'), '.3f')}.")
            headline[(bench, lr, "merged")] = _m(col("merged_reach"))
    lo = min(lr for _, lr in sets)
    h = {k[2]: v for k, v in headline.items() if k[:2] == (BENCH, lo)}
    if all(k in h for k in ("rtn", "stochastic", "merged")):
        grid = {k[2]: v for k, v in headline.items() if k[:2] == (BENCH_A_GRID, lo)}
        extra = (f"; A on the bf16 grid: RTN {_fmt(grid['rtn'][2], '.3f')}, SR {_fmt(grid['stochastic'][2], '.3f')} "
                 "of the A update" if "rtn" in grid and "stochastic" in grid else "")
        ef = f", EF {h['error_feedback'][1]:.3f}" if "error_feedback" in h else ""
        say(f"\nAt lr {lo:g}, the share of each step's ΔD = s·B·A reaching the served policy: adapters RTN "
            f"{h['rtn'][1]:.3f}, SR {h['stochastic'][1]:.3f}{ef}{extra}; merged RTN {h['merged']:.3f}")
        say(f"merged_rtn_share_of_adapter_update_at_{lo:g}: {h['merged']:.3f}")
    text = "\n".join(lines)
    print(text)
    with open(out_path, "w") as f:
        f.write(text + "\n")


def _evals(at):
    return sorted({s for rs in at.values() for r in rs for s in r["evals"]})


def _fmt(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=24, help="replay: prompts (groups)")
    parser.add_argument("--generations", type=int, default=8, help="replay: completions per prompt")
    parser.add_argument("--jsonl", default=JSONL)
    parser.add_argument("--rollouts", default=ROLLOUTS)
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--report-file", default=REPORT)
    parser.add_argument("--a-on-grid", action="store_true",
                        help="start the A factors on the bf16 grid (as TRL's bf16 QLoRA factors upcast to fp32 "
                             "masters)")
    parser.add_argument("--time-step", action="store_true", help="2 steps per rule at the first lr, not recorded")
    args = parser.parse_args()
    if args.report:
        report(args.jsonl, args.report_file)
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    if len(args.seeds) < 3 and not args.time_step:
        parser.error("give at least 3 seeds (--seeds)")
    rollouts = make_rollouts(args.rollouts, args.prompts, args.generations)
    useful = sum(statistics.pstdev(g["rewards"]) > 0 for g in rollouts["groups"])
    print(f"replay: {len(rollouts['groups'])} groups, {useful} with a reward spread (generated in "
          f"{rollouts['seconds']} s)")
    if args.time_step:
        for mode in args.modes:
            print(f"{mode}: median step {run(args.lrs[0], args.seeds[0], mode, 2, rollouts, args.jsonl, True):.1f} s")
        return
    for lr in args.lrs:
        for seed in args.seeds:
            for mode in args.modes:  # interleaved per seed: paired runs finish together
                t0 = time.perf_counter()
                median = run(lr, seed, mode, args.steps, rollouts, args.jsonl, a_on_grid=args.a_on_grid)
                if not math.isnan(median):
                    print(f"lr {lr:g} seed {seed} {mode}: {time.perf_counter() - t0:.0f} s (median step "
                          f"{median:.1f} s)", flush=True)
    report(args.jsonl, args.report_file)


if __name__ == "__main__":
    main()
