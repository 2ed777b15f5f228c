"""Fast QLoRA against plain QLoRA and 16-bit LoRA: GRPO step time, generation time, memory, dequantizations per
step, and what the fast path changes in the numbers.

One random-weight Qwen2 built from a config (default 2 blocks, hidden 1024, MLP 4096, 16 heads of 64, 2 KV heads,
the character tokenizer's 128-slot vocabulary: 30M parameters, 120 MB in fp32; ``--full``: 8 blocks, 120M
parameters, 479 MB, the run the documented figures come from), saved to a temporary folder with a
local tokenizer and loaded by each trainer as a user's TRL script loads a checkpoint. Three arms on the same model,
batch and seed:

    (a) lora16  16-bit LoRA: the base in the compute dtype (fp32 on CPU), no quantization; trl_fp8.GRPOConfig with
                every trl_fp8 field at its default, i.e. plain TRL
    (b) qlora   QLoRA as TRL runs it today: the base loaded with BitsAndBytesConfig(load_in_4bit=True, nf4, compute
                dtype as (a)), fast_qlora="off"
    (c) fast    the same 4-bit load with fast_qlora="on": qlora_keep_budget_gb=--keep-gb (default 0.0625, a
                quarter of the field's default, as the model is a quarter of ``--full``'s; ``--full``: 0.25, the
                field's default: dense copies of the highest-error layers; about half of the model's, either way),
                qlora_rollout_cache_gb=--cache-gb (default 1.0, set so the memory goal has a stated budget; the
                field's default is automatic), qlora_cache_dtype = the compute dtype, so that all arms compute
                at the same activation precision (like for like: the headline)
    (c') fast_auto  the same with qlora_cache_dtype="auto" (bf16 rollouts on an AVX512-BF16/AMX CPU: faster, but
                not like for like with (a) and (b); reported beside, not in the headline; run only where "auto"
                resolves to another dtype than the compute dtype: elsewhere it would be (c) again)

Each step: 8 completions (4 per prompt) of exactly 64 tokens. LoRA r=16, alpha=32, dropout 0, on every linear;
gradient checkpointing off in every arm (with it on, (b) would dequantize each layer once more per step); lr 1e-4,
constant. Fixed lengths: TRL's ``generation_kwargs`` gets ``min_new_tokens = max_completion_length``, so EOS is
masked until the last token (sampling at temperature 1; the reward is the share of digits, so that advantages are
not all zero).

Timing: each arm's trainer is built once; a run is one ``trainer.train()`` of ``--steps`` optimizer steps, and its
figures are medians over the steps after the first. A repetition runs every arm once, in an order that rotates
between repetitions (drift hits all arms alike), after one untimed warm-up run per arm. "step" is the wall time of
an optimizer step (generation + reward + loss forward + backward + optimizer, TRL's step as it runs); "generation"
is the part of that step spent inside the trainer's generation call (for (c) that includes building the rollout
cache). Ratios are computed per repetition and the median over repetitions is printed.

Dequantizations per step: (b) counts every pass over a 4-bit weight with ``trl_fp8.fast_qlora.counters.DequantCounter``
attached to its model (each 4-bit forward, each backward through one); (c) is the trainer's own
``qlora/dequant_calls`` metric (the same counter, plus the explicit dequantizations that build the rollout cache).

Memory: on CPU each arm is built and trained (``--steps`` steps) once more in a forked child, which reports its
anonymous resident memory (RssAnon: heap and tensors, not mapped files or library code) after the build and its
peak during the steps (sampled every 2 ms by a thread), both minus its value before the build: the model's,
optimizer's, activations' and caches' memory as the OS sees it (allocator caching included). Weights are first
copied out of the safetensors file mapping a load can leave them in (all of (a)'s are), so that every arm's weights
are counted alike. On CUDA the same two figures come from ``torch.cuda.memory_allocated`` and
``max_memory_allocated`` around each arm's build and first run (the warm-up).

Equivalence, per seed (``--seeds``):
- budgets 0: (c) with qlora_keep_budget_gb=0 and qlora_rollout_cache_gb=0 against a fresh (b), same seed,
  ``--steps`` steps: every loss and the adapter weights after the steps must be identical bit for bit (asserted;
  GRPO's loss on its own fresh rollouts is −mean advantage ≈ 0, so the adapter weights are the telling half);
- budgets on: the timed (b) and (c) get the same random adapter (lora_B scaled so that ‖ΔW‖ = 1% ‖dequant(W)‖ in
  each layer), then decode the same prompts greedily (train mode, as TRL generates): the fraction of completions
  identical to (b)'s; and on (b)'s sequences the max per-token |Δ logprob| of (c) against (b), as TRL's loss
  computes them, once through (c)'s rollout path (the cache) and once through its loss path (kept dense layers +
  4-bit). A random-weight model has flat next-token distributions, so greedy ties flip easily: the logprob gap is
  the figure to judge the numerics by.

    python benchmarks/qlora_speed.py [--layers 2] [--hidden 1024] [--reps 5] [--steps 3] [--seeds 1] [--full | --quick]

The default (2 blocks of the full run's shape, 5 repetitions, 1 seed) gives the headline in under 10 minutes on a
2-core CPU; ``--full`` is the 8-block run with 2 seeds (over 25 minutes there) behind the documented figures;
``--quick`` is a smoke run (seconds; the figures mean nothing).

Last line: ``qlora_step_ratio_vs_lora16: <number>`` -- step time (c) / (a), median over repetitions.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARMS = ("lora16", "qlora", "fast", "fast_auto")
ARM_LABELS = {"lora16": "(a) 16-bit LoRA", "qlora": "(b) QLoRA (TRL today)", "fast": "(c) trl_fp8 fast QLoRA",
              "fast_auto": "(c') fast, cache auto"}
HEAD_DIM = 64
VOCAB = 128  # the character tokenizer's 99 tokens, padded as the demo model pads them
DELTA_NORM = 0.01  # ‖ΔW‖ / ‖dequant(W)‖ of the adapters the budgets-on comparison installs
MIB = 2**20
GIB = 2**30


@dataclass
class Setup:
    """Everything that defines the comparison; the same for every arm."""

    device: str = "cpu"
    dtype: str = "float32"  # the base's (a) and the 4-bit layers' compute dtype (b, c)
    layers: int = 2  # --full: 8
    hidden: int = 1024
    intermediate: int | None = None  # default 4 × hidden
    batch: int = 8  # completions per step (per_device_train_batch_size)
    generations: int = 4  # completions per prompt
    completion: int = 64  # tokens per completion (fixed)
    steps: int = 3  # optimizer steps per run; the first is not timed
    reps: int = 5
    seeds: int = 1  # --full: 2
    keep_gb: float = 0.0625  # --full: 0.25
    cache_gb: float = 1.0
    warmup: bool = True
    seed: int = 0
    extra: dict = field(default_factory=dict)  # extra GRPOConfig fields for every arm
    model: str | None = None  # a pretrained model (e.g. trl-fp8:smollm2) instead of the random-weight Qwen2

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


def model_config(setup: Setup):
    from transformers import Qwen2Config

    from trl_fp8.tokenization import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    heads = setup.hidden // HEAD_DIM
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=setup.hidden, intermediate_size=setup.intermediate or 4 * setup.hidden,
        num_hidden_layers=setup.layers, num_attention_heads=heads, num_key_value_heads=2 if heads % 2 == 0 else 1,
        head_dim=HEAD_DIM, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )


def build_model_dir(path: str, setup: Setup) -> int:
    """Save the random-weight model (in the compute dtype) and the tokenizer to ``path``; returns its parameters.
    With ``setup.model``, that pretrained model (resolved like any model id) in the compute dtype instead."""
    import torch
    from transformers import Qwen2ForCausalLM

    from trl_fp8.tokenization import build_char_tokenizer

    if setup.model is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trl_fp8.models import resolve_model

        source = resolve_model(setup.model)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=setup.torch_dtype)
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
        n = sum(p.numel() for p in model.parameters())
        del model
        gc.collect()
        return n

    torch.manual_seed(setup.seed)
    with torch.device(setup.device):  # random init on the device: seconds for a 0.5B shape on a GPU
        model = Qwen2ForCausalLM(model_config(setup)).to(setup.torch_dtype)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    return n


def digit_share(completions, **kwargs) -> list[float]:
    """Reward: the share of digits in the completion (dense, so a random policy's advantages are not all zero)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def grpo_config(arm: str, setup: Setup, output_dir: str, seed: int, **overrides):
    from transformers import BitsAndBytesConfig

    import trl_fp8

    kwargs = dict(
        output_dir=output_dir, use_cpu=setup.device == "cpu", bf16=setup.device != "cpu" and setup.dtype == "bfloat16",
        max_steps=setup.steps, learning_rate=1e-4, lr_scheduler_type="constant",
        per_device_train_batch_size=setup.batch, num_generations=setup.generations,
        max_completion_length=setup.completion, generation_kwargs={"min_new_tokens": setup.completion},
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False,
        seed=seed, **setup.extra,
    )
    if arm == "lora16":
        kwargs["model_init_kwargs"] = {"dtype": setup.torch_dtype}
    else:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_compute_dtype=setup.torch_dtype)
        kwargs["model_init_kwargs"] = {"quantization_config": quant, "dtype": setup.torch_dtype}
    if arm in ("fast", "fast_auto"):
        # (c) caches in the compute dtype, so that every arm computes at the same activation precision; (c') lets
        # qlora_cache_dtype="auto" pick (bf16 rollouts on a CPU with native bf16: faster, not like for like)
        kwargs.update(fast_qlora="on", qlora_keep_budget_gb=setup.keep_gb, qlora_rollout_cache_gb=setup.cache_gb,
                      qlora_cache_dtype=setup.dtype if arm == "fast" else "auto")
    kwargs.update(overrides)
    return trl_fp8.GRPOConfig(**kwargs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _probe_callback(run):
    """A TrainerCallback recording, per optimizer step: wall time, time inside generation, and (b)'s dequants."""
    from transformers import TrainerCallback

    class StepProbe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if run.counter is not None:
                run.counter.reset()
            run.gen_in_step = 0.0
            _sync(run.setup.device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(run.setup.device)
            run.step_times.append(time.perf_counter() - self._t0)
            run.gen_times.append(run.gen_in_step)
            if run.counter is not None:
                run.dequants.append(run.counter.reset()["total"])
            if run.capability is not None:  # what (c) runs with (its edits are undone when training ends)
                edits = run.capability.edits
                run.kept = (f"{len(edits.kept)} of {len(run.capability.layers)} 4-bit layers kept dense "
                            f"({edits.kept_bytes / MIB:.1f} MiB)")

    return StepProbe()


class Run:
    """One arm's trainer, built once; :meth:`train` runs ``setup.steps`` optimizer steps and returns its figures."""

    def __init__(self, arm: str, setup: Setup, model_dir: str, workdir: str, seed: int | None = None, **overrides):
        import torch
        from peft import LoraConfig
        from transformers.trainer_callback import PrinterCallback

        import trl_fp8
        from trl_fp8 import fourbit
        from trl_fp8.fast_qlora.counters import DequantCounter
        from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

        self.arm, self.setup = arm, setup
        self.seed = setup.seed if seed is None else seed
        args = grpo_config(arm, setup, os.path.join(workdir, f"{arm}-{self.seed}"), self.seed, **overrides)
        self.memory = {}
        if setup.device.startswith("cuda"):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        torch.manual_seed(self.seed)  # TRL applies the LoRA config before the Trainer seeds: same adapters per arm
        self.trainer = trl_fp8.GRPOTrainer(
            model=model_dir, reward_funcs=[digit_share], args=args,
            train_dataset=make_arithmetic_dataset(512, seed=self.seed),
            peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0),
        )
        self.trainer.remove_callback(PrinterCallback)
        self.model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        fourbit.guard_cpu_repack(self.model)  # bitsandbytes' CPU repack trap, in every 4-bit arm
        self.capability = self.trainer.capability("fast_qlora")
        self.counter = None
        if arm == "qlora":
            self.counter = DequantCounter()
            self.counter.attach(self.model)
        if setup.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.memory["resident"] = torch.cuda.memory_allocated() - before
        self.step_times, self.gen_times, self.dequants, self.losses = [], [], [], []
        self.gen_in_step = 0.0
        self.kept = None
        self.trainer.add_callback(_probe_callback(self))
        self._instrument()

    def _instrument(self) -> None:
        trainer = self.trainer
        generate, compute_loss = trainer._generate_single_turn, trainer.compute_loss

        def timed_generate(*args, **kwargs):
            _sync(self.setup.device)
            start = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                _sync(self.setup.device)
                self.gen_in_step += time.perf_counter() - start

        def recorded_loss(*args, **kwargs):
            loss = compute_loss(*args, **kwargs)
            self.losses.append((loss[0] if isinstance(loss, tuple) else loss).detach().clone())
            return loss

        trainer._generate_single_turn = timed_generate  # instance attributes: the class's methods stay TRL's
        trainer.compute_loss = recorded_loss

    def train(self) -> dict:
        """One ``trainer.train()``; medians over its steps after the first (all steps when only one ran)."""
        import torch
        from transformers import set_seed

        self.step_times, self.gen_times, self.dequants = [], [], []
        # CUDA memory: the first run only, when nothing of this arm but its build is allocated (later runs start
        # with its optimizer state, and (c) rebuilds its kept layers after undoing them at the end of each run)
        cuda = self.setup.device.startswith("cuda") and "peak" not in self.memory
        if cuda:
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        set_seed(self.seed)
        self.trainer.train()
        if cuda:
            torch.cuda.synchronize()
            self.memory["peak"] = torch.cuda.max_memory_allocated() - start + self.memory["resident"]
        timed = slice(1, None) if len(self.step_times) > 1 else slice(None)
        if self.capability is not None:
            self.dequants = [e["qlora/dequant_calls"] for e in self.trainer.state.log_history
                             if "qlora/dequant_calls" in e]
        out = {"step": statistics.median(self.step_times[timed]), "gen": statistics.median(self.gen_times[timed]),
               "dequant": statistics.median(self.dequants[timed]) if self.dequants else None}
        if self.capability is not None:
            out["cache_bytes"] = self.capability.cache.bytes
            out["kept"] = self.kept
        return out

    def lora_parameters(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if "lora_" in n}

    def close(self) -> None:
        if self.counter is not None:
            self.counter.detach()
        self.trainer = self.model = self.capability = None
        gc.collect()
        if self.setup.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


# -- memory on CPU: a forked child per arm ---------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _settle() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the resident set means what is in use."""
    gc.collect()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _materialize(model) -> None:
    """Copy every parameter and buffer into anonymous memory. A safetensors load may leave tensors (all of (a)'s
    weights) in the file's mapping, which RssAnon does not see; the mapping itself lingers after any load."""
    import torch

    copies = {}
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            key = tensor.data_ptr()
            if key not in copies:
                copies[key] = tensor.data.clone()
            tensor.data = copies[key]


class _PeakSampler:
    """Samples RssAnon every ``interval`` seconds in a thread (torch releases the GIL in its kernels); ``peak`` is the
    largest sample, in KiB. Activations that live for less than an interval can be missed."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.peak = interval, _status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _status_kib("RssAnon"))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon"))


def _memory_child(conn, arm, setup, model_dir, workdir) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # a forked child: no inherited OpenMP pool
        _settle()
        start = _status_kib("RssAnon")
        run = Run(arm, setup, model_dir, workdir)
        _materialize(run.model)
        _settle()
        resident = _status_kib("RssAnon") - start
        with _PeakSampler() as sampler:
            run.train()
        conn.send({"resident": resident * 1024, "peak": (sampler.peak - start) * 1024})
    except BaseException as err:  # noqa: BLE001 -- reported by the parent
        import traceback

        conn.send({"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"})
    finally:
        conn.close()


def _preload() -> None:
    """Import what building a trainer imports, so that the children's resident sets do not count module code."""
    import bitsandbytes  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401

    import trl_fp8.fast_qlora.component  # noqa: F401
    import trl_fp8.trainer  # noqa: F401


def cpu_memory(arm: str, setup: Setup, model_dir: str, workdir: str) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_memory_child, args=(send, arm, setup, model_dir, workdir))
    child.start()
    send.close()
    try:
        result = recv.recv()
    except EOFError:
        result = {"error": "the child exited without a report"}
    child.join()
    if "error" in result:
        raise RuntimeError(f"memory probe for arm {arm} failed: {result['error']}")
    return result


# -- equivalence ------------------------------------------------------------------------------------------------------
def equivalence_budgets_zero(setup: Setup, model_dir: str, workdir: str, seed: int) -> dict:
    """(c) with both budgets 0 against (b), fresh trainers, same seed: losses and final adapters, bit for bit."""
    import torch

    plain = Run("qlora", setup, model_dir, workdir, seed)
    plain.train()
    fast = Run("fast", setup, model_dir, workdir, seed, qlora_keep_budget_gb=0.0, qlora_rollout_cache_gb=0.0)
    fast.train()
    losses_equal = len(plain.losses) == len(fast.losses) and all(
        torch.equal(a, b) for a, b in zip(plain.losses, fast.losses))
    weights_a, weights_b = plain.lora_parameters(), fast.lora_parameters()
    weights_equal = weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k])
                                                                  for k in weights_a)
    out = {"steps": len(plain.losses), "losses_equal": losses_equal, "weights_equal": weights_equal,
           "losses": [float(x) for x in plain.losses]}
    plain.close()
    fast.close()
    return out


def _set_adapters(runs, seed: int) -> float:
    """The same random adapter in every run of ``runs``: lora_A as initialized by (b), lora_B random and scaled so
    that ‖ΔW‖ = DELTA_NORM · ‖dequant(W)‖ per layer. Returns the median ‖ΔW‖ / ‖W‖ after rounding to the adapters'
    dtype."""
    import torch

    from trl_fp8 import fourbit

    source = runs[0]
    gen = torch.Generator().manual_seed(seed)
    ratios = []
    with torch.no_grad():
        for _, layer in fourbit.lora_layers(source.model):
            for adapter in layer.active_adapters:
                b = layer.lora_B[adapter].weight
                b.copy_(torch.randn(b.shape, generator=gen).to(b.dtype))
            base = layer.get_base_layer()
            weight = fourbit.dequantize(base, torch.float32)
            scale = DELTA_NORM * weight.norm() / fourbit.lora_delta(layer).norm()
            for adapter in layer.active_adapters:
                b = layer.lora_B[adapter].weight
                b.copy_((b.float() * scale).to(b.dtype))
            ratios.append(float(fourbit.lora_delta(layer).norm() / weight.norm()))
        values = source.lora_parameters()
        for run in runs[1:]:
            params = dict(run.model.named_parameters())
            for name, value in values.items():
                params[name].copy_(value)
    return statistics.median(ratios)


def equivalence_budgets_on(plain: Run, fast: Run, setup: Setup, seed: int) -> dict:
    """Greedy completions and per-token logprobs of (c) (budgets on) against (b), same adapters, same prompts."""
    import torch

    from trl_fp8 import _trl
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    fast.capability.redo()  # the training-time policy (kept dense layers), as a step sees it
    delta = _set_adapters([plain, fast], seed)
    tokenizer = plain.trainer.processing_class
    prompts = [row["prompt"] for row in make_arithmetic_dataset(setup.batch, seed=1000 + seed)]
    device = plain.trainer.accelerator.device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
    n = setup.completion
    greedy = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        for run in (plain, fast):
            run.model.train()  # TRL generates in train mode
        seq_plain = plain.model.generate(**enc, **greedy)
        with fast.capability.generating(fast.trainer):
            seq_fast = fast.model.generate(**enc, **greedy)
        identical = (seq_plain == seq_fast).all(dim=1).float().mean().item()
        comp_plain, comp_fast = seq_plain[:, -n:], seq_fast[:, -n:]
        prefix = (comp_plain == comp_fast).int().cumprod(dim=1).sum(dim=1).float().mean().item()
        attention = torch.cat([enc["attention_mask"], torch.ones_like(comp_plain)], dim=1)

        def logps(run):
            return _trl.policy_logps(run.trainer, run.trainer.model, seq_plain, attention, n).float()

        ref = logps(plain)
        with fast.capability.generating(fast.trainer):
            rollout = logps(fast)
        loss_path = logps(fast)
    return {"identical": identical, "prefix": prefix, "rows": len(prompts), "delta": delta,
            "rollout_gap": (rollout - ref).abs().max().item(), "loss_gap": (loss_path - ref).abs().max().item(),
            "cache_dtype": str(fast.capability.cache_dtype).removeprefix("torch.")}


# -- the comparison ---------------------------------------------------------------------------------------------------
def arms_for(setup: Setup) -> tuple:
    """Every arm, but (c') only where ``qlora_cache_dtype="auto"`` resolves to another dtype than the compute dtype
    (a CPU with native bf16): elsewhere it is (c) again, run for nothing."""
    import torch

    from trl_fp8.fast_qlora.component import resolve_cache_dtype

    auto = resolve_cache_dtype("auto", setup.torch_dtype, torch.device(setup.device))
    return ARMS if auto != setup.torch_dtype else tuple(a for a in ARMS if a != "fast_auto")


def run_comparison(setup: Setup, log=None) -> dict:
    """Build the model, measure every arm (memory, interleaved timing), then the equivalence figures."""
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    arms = arms_for(setup)
    results = {"setup": setup, "arms": arms}
    if "fast_auto" not in arms:
        log(f"(c') not run: qlora_cache_dtype='auto' resolves to {setup.dtype} here, the compute dtype: it would be (c)")
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = os.path.join(workdir, "model")
        results["parameters"] = build_model_dir(model_dir, setup)
        log(f"model: {describe_model(results['parameters'], setup)}, {setup.dtype}, in {model_dir}")
        memory = {}
        if setup.device.startswith("cuda"):
            import torch

            torch.ones(8, 8, device=setup.device) @ torch.ones(8, 8, device=setup.device)  # cuBLAS workspace first
        if setup.device == "cpu":
            _preload()
            for arm in arms:  # before anything else runs here: the children fork a lean parent
                memory[arm] = cpu_memory(arm, setup, model_dir, workdir)
                log(f"memory {arm}: resident {memory[arm]['resident'] / MIB:.0f} MiB, "
                    f"peak {memory[arm]['peak'] / MIB:.0f} MiB")

        runs = {arm: Run(arm, setup, model_dir, workdir) for arm in arms}
        if setup.warmup:
            for arm in arms:
                runs[arm].train()
        per_rep = []
        for rep in range(setup.reps):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            figures = {arm: runs[arm].train() for arm in order}
            per_rep.append(figures)
            log(f"rep {rep + 1}: " + ", ".join(
                f"{arm} step {figures[arm]['step']:.3f} s gen {figures[arm]['gen']:.3f} s" for arm in arms))
            # the headline so far, after each repetition: a time limit that stops the run later leaves it standing
            so_far = _ratio_median(per_rep, "fast", "lora16", "step")
            log(f"step time (c)/(a) so far, median of {len(per_rep)} repetition(s): {_fmt(so_far, '.3f')}")
        if setup.device != "cpu":
            memory = {arm: dict(runs[arm].memory) for arm in arms}
        results.update(per_rep=per_rep, memory=memory)

        results["budgets_on"] = [equivalence_budgets_on(runs["qlora"], runs["fast"], setup, s)
                                 for s in range(setup.seeds)]
        if "fast_auto" in runs:
            results["budgets_on_auto"] = [equivalence_budgets_on(runs["qlora"], runs["fast_auto"], setup, s)
                                          for s in range(setup.seeds)]
        for run in runs.values():
            run.close()
        results["budgets_zero"] = [equivalence_budgets_zero(setup, model_dir, workdir, s)
                                   for s in range(setup.seeds)]
    return results


def describe_model(parameters: int, setup: Setup) -> str:
    if setup.model is not None:
        return f"{setup.model} (pretrained weights), {parameters / 1e6:.1f}M parameters"
    return f"random-weight Qwen2, {parameters / 1e6:.1f}M parameters ({setup.layers} layers, hidden {setup.hidden})"


def _median(per_rep, arm, key):
    return statistics.median(r[arm][key] for r in per_rep)


def _ratio_median(per_rep, num, den, key):
    """Median over repetitions of num/den; None when any denominator is zero (nothing to divide by)."""
    pairs = [(r[num][key], r[den][key]) for r in per_rep]
    if any(d == 0 for _, d in pairs):
        return None
    return statistics.median(n / d for n, d in pairs)


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a (zero denominator)" if value is None else format(value, spec)


def report(results: dict, out=print, strict: bool = True) -> None:
    """The table, the ratios, the equivalence figures, the goals; the headline line last. ``strict``: assert the
    budgets-0 equivalence (bit for bit) instead of only reporting it."""
    setup, per_rep, memory = results["setup"], results["per_rep"], results["memory"]
    mem_what = ("anonymous resident memory (RssAnon) minus its value before the build, in a forked child, weights "
                "copied out of the safetensors mapping; resident: after the build; peak: sampled every 2 ms during "
                f"{setup.steps} steps" if setup.device == "cpu" else
                "torch.cuda.memory_allocated minus its value before the build; resident: after the build; peak: "
                f"max_memory_allocated during the arm's first run ({setup.steps} steps)")
    out(f"\nmodel: {describe_model(results['parameters'], setup)}, {setup.dtype} compute, {setup.device}; "
        f"{setup.batch} completions of {setup.completion} "
        f"tokens per step ({setup.generations} per prompt); {setup.reps} repetitions × {setup.steps} steps per run "
        f"(first step of each run untimed); medians")
    out(f"{'arm':<24} | {'step s':>8} | {'generation s':>12} | {'gen share':>9} | {'dequant/step':>12} | "
        f"{'resident MiB':>12} | {'peak MiB':>9}")
    for arm in results.get("arms", ARMS):
        step, gen = _median(per_rep, arm, "step"), _median(per_rep, arm, "gen")
        dq = [r[arm]["dequant"] for r in per_rep if r[arm]["dequant"] is not None]
        dq_text = f"{statistics.median(dq):.0f}" if dq else "—"
        m = memory.get(arm, {})
        out(f"{ARM_LABELS[arm]:<24} | {step:>8.3f} | {gen:>12.3f} | {gen / step:>9.0%} | {dq_text:>12} | "
            f"{m.get('resident', 0) / MIB:>12.0f} | {m.get('peak', 0) / MIB:>9.0f}")
    last = per_rep[-1]["fast"]
    out("step s: wall time of one optimizer step (generation + reward + loss forward + backward + optimizer); "
        "generation s: the part of it inside the trainer's generation call; dequant/step: passes over a 4-bit weight "
        "per step")
    out(f"(c): {last['kept']}; rollout cache {last['cache_bytes'] / MIB:.1f} MiB "
        f"(budgets: keep {setup.keep_gb} GiB, cache {setup.cache_gb} GiB)")
    out(f"memory: {mem_what}")

    gen_speedup = _ratio_median(per_rep, "qlora", "fast", "gen")
    step_vs_qlora = _ratio_median(per_rep, "fast", "qlora", "step")
    headline = _ratio_median(per_rep, "fast", "lora16", "step")
    per_gen = ", ".join(_fmt(_ratio(r["qlora"]["gen"], r["fast"]["gen"])) for r in per_rep)
    out(f"generation time, speed-up (b)/(c): {_fmt(gen_speedup)} (per repetition {per_gen})")
    out(f"step time (c)/(b): {_fmt(step_vs_qlora)}; step time (b)/(a): "
        f"{_fmt(_ratio_median(per_rep, 'qlora', 'lora16', 'step'))}")
    dq_b = statistics.median(r["qlora"]["dequant"] for r in per_rep)
    dq_c = statistics.median(r["fast"]["dequant"] for r in per_rep)
    dq_ratio = _ratio(dq_b, dq_c)
    out("dequantizations per step (b)/(c): " + (f"{dq_ratio:.1f} ({dq_b:.0f} / {dq_c:.0f})" if dq_ratio is not None
                                                  else f"∞ ((b) {dq_b:.0f}, (c) 0: every 4-bit layer kept dense)"))

    zero = results["budgets_zero"]
    if strict:
        for z in zero:
            assert z["losses_equal"] and z["weights_equal"], f"budgets 0: (c) differs from (b): {z}"
    out(f"budgets 0, (c) vs (b), bit for bit over {len(zero)} seed(s) × {zero[0]['steps']} steps: losses identical "
        f"{all(z['losses_equal'] for z in zero)}, adapter weights after the steps identical "
        f"{all(z['weights_equal'] for z in zero)} (losses seed 0: {', '.join(f'{x:.3g}' for x in zero[0]['losses'])})")
    for key, label in (("budgets_on", "(c)"), ("budgets_on_auto", "(c')")):
        if key not in results:
            continue
        on = results[key]
        identical = sum(e["identical"] * e["rows"] for e in on) / sum(e["rows"] for e in on)
        out(f"budgets on, {label} vs (b), same adapters (‖ΔW‖/‖W‖ {statistics.median(e['delta'] for e in on):.3f}), "
            f"{len(on)} seed(s) × {on[0]['rows']} prompts: greedy completions identical {identical:.0%} (mean "
            f"identical prefix {statistics.mean(e['prefix'] for e in on):.1f} of {setup.completion} tokens); max "
            f"per-token |Δ logprob| on (b)'s sequences: rollout path (cache {on[0]['cache_dtype']}) "
            f"{max(e['rollout_gap'] for e in on):.3g}, loss path {max(e['loss_gap'] for e in on):.3g}")
    if "budgets_on_auto" in results:
        auto_gen = _ratio_median(per_rep, "qlora", "fast_auto", "gen")
        auto_step = _ratio_median(per_rep, "fast_auto", "lora16", "step")
        out(f"(c') cache dtype auto ({results['budgets_on_auto'][0]['cache_dtype']}): generation speed-up over (b) "
            f"{_fmt(auto_gen)}, step time (c')/(b) {_fmt(_ratio_median(per_rep, 'fast_auto', 'qlora', 'step'))}, "
            f"(c')/(a) {_fmt(auto_step)} (rollout activations in the cache dtype: not like for like with (a))")
    else:
        out("(c') cache dtype auto: not run (it resolves to the compute dtype here: it would be (c))")

    budget = (setup.keep_gb + setup.cache_gb) * GIB
    goals = [
        ("dequantizations per step ≥ 20× fewer than (b)", dq_ratio is None or dq_ratio >= 20),
        ("generation ≥ 1.3× faster than (b)", None if gen_speedup is None else gen_speedup >= 1.3),
        ("step no slower than (b)", None if step_vs_qlora is None else step_vs_qlora <= 1.0),
        ("peak memory (c) ≤ (b) + keep + cache budgets",
         memory["fast"]["peak"] <= memory["qlora"]["peak"] + budget if memory else None),
    ]
    for text, met in goals:
        out(f"goal: {text}: {'met' if met else 'not met' if met is not None else 'not measured'}")
    per_step = ", ".join(_fmt(_ratio(r["fast"]["step"], r["lora16"]["step"])) for r in per_rep)
    out(f"step time (c)/(a) per repetition: {per_step}; the headline is their median")
    out(f"qlora_step_ratio_vs_lora16: {headline:.3f}" if headline is not None else "qlora_step_ratio_vs_lora16: n/a")


FULL = dict(layers=8, seeds=2, keep_gb=0.25)  # the documented run: over 25 minutes on a 2-core CPU
QUICK = dict(layers=2, hidden=64, intermediate=128, batch=4, generations=2, completion=16, steps=2, reps=1, seeds=1,
             keep_gb=1e-4, cache_gb=0.01, warmup=False)  # a smoke run: seconds, figures not meaningful


def add_arguments(parser, defaults: Setup) -> None:
    """The shared arguments; ``defaults`` is the full run's :class:`Setup` (shown in the help)."""
    parser.add_argument("--layers", type=int, help=f"transformer blocks (default {defaults.layers})")
    parser.add_argument("--hidden", type=int,
                        help=f"hidden size, a multiple of {HEAD_DIM} (default {defaults.hidden}; the MLP is 4x wide "
                             "unless the default shape is kept)")
    parser.add_argument("--reps", type=int, help=f"interleaved repetitions, >= 5 (default {defaults.reps})")
    parser.add_argument("--steps", type=int,
                        help=f"optimizer steps per run, >= 2; the first is not timed (default {defaults.steps})")
    parser.add_argument("--seeds", type=int, help=f"seeds of the equivalence figures, >= 1 (default {defaults.seeds})")
    parser.add_argument("--keep-gb", type=float, help=f"(c)'s qlora_keep_budget_gb (default {defaults.keep_gb})")
    parser.add_argument("--cache-gb", type=float,
                        help=f"(c)'s qlora_rollout_cache_gb (default {defaults.cache_gb})")
    parser.add_argument("--model", help="a pretrained model id (e.g. trl-fp8:smollm2) instead of the random-weight "
                        "Qwen2 (--layers/--hidden then do not apply)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 layers, hidden 64, 16-token completions, 1 repetition of 2 steps, no "
                             "warm-up, 1 seed (seconds; the figures are not meaningful)")


def setup_from_args(parser, args, defaults: Setup) -> Setup:
    """A validated :class:`Setup`: ``defaults`` (or the quick shape), then the arguments given."""
    full = getattr(args, "full", False)  # (qlora_speed.py's own flag; the GPU check has its own shape)
    if args.quick and full:
        parser.error("--quick and --full are exclusive")
    setup = replace(defaults, **QUICK) if args.quick else replace(defaults, **FULL) if full else defaults
    given = {k: getattr(args, k) for k in ("layers", "hidden", "reps", "steps", "seeds", "keep_gb", "cache_gb")
             if getattr(args, k) is not None}
    if "hidden" in given and given["hidden"] != setup.hidden:
        given["intermediate"] = None  # a custom width gets the 4x MLP
    setup = replace(setup, **given)
    if args.model:
        if "layers" in given or "hidden" in given:
            parser.error("--layers/--hidden shape the random-weight model; a --model has its own shape")
        setup = replace(setup, model=args.model)
    if setup.layers < 1:
        parser.error(f"--layers must be >= 1, got {setup.layers}")
    if setup.hidden < HEAD_DIM or setup.hidden % HEAD_DIM:
        parser.error(f"--hidden must be a positive multiple of {HEAD_DIM} (the head width), got {setup.hidden}")
    if setup.reps < (1 if args.quick else 5):
        parser.error(f"--reps must be >= 5 (the figures are medians over repetitions), got {setup.reps}")
    if setup.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step of each run is not timed), got {setup.steps}")
    if setup.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {setup.seeds}")
    for name in ("keep_gb", "cache_gb"):
        value = getattr(setup, name)
        if not 0 <= value < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a number of GiB >= 0, got {value}")
    return setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, Setup())
    parser.add_argument("--full", action="store_true",
                        help="the documented run: 8 layers, 2 seeds, keep budget 0.25 GiB (over 25 minutes on a "
                             "2-core CPU; the default takes under 10)")
    args = parser.parse_args()
    setup = setup_from_args(parser, args, Setup())
    report(run_comparison(setup))


if __name__ == "__main__":
    main()
