"""Run one training configuration uninterrupted and as a series of sessions each killed with SIGKILL at a chosen
point, every session resuming with ``resume_from_checkpoint="auto"``; write what the tests compare.

usage: python kill_runner.py CONFIG OUT_DIR KILL [KILL ...]

CONFIG is a key of :data:`CONFIGS`. Each KILL is the point where one session dies (the session after the last KILL
runs to the end):

- ``step:S``: inside optimizer step S, after its forward and backward, before the optimizer step;
- ``gen:S:K``: during the generation of step S, at the K-th module forward of the generation;
- ``save:S:WHERE``: during the save of checkpoint-S: after the ``model`` files, after ``optimizer`` and scheduler,
  after the ``rng`` state, after every file but before the completion ``marker``, after the marker but before the
  ``rename``, or in the ``rotate`` that follows (a folder renamed aside, not yet deleted).

Every kill point is reached deterministically (no timers): the process kills itself there with
``os.kill(os.getpid(), SIGKILL)`` — the kernel stops it at once, as ``kill -9`` from outside would.

The process imports torch, transformers, TRL and trl_fp8 once and forks one child per session (imports are most of
a session's cost here), so a session is a real separate process that dies without running any cleanup. The parent
runs no torch code itself. Per session, OUT_DIR/<name>/session-<i>.log holds the child's output, and the uninterrupted
run (``reference``) and the interrupted one (``killed``) each leave ``final_state.pt`` (model, optimizer, capability
states, RNG states) and ``metrics.jsonl``. OUT_DIR/result.json records how each session ended.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRL_FP8_CACHE", __import__("tempfile").mkdtemp(prefix="trl_fp8_kernels_"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import trl_fp8  # noqa: E402
from trl_fp8 import checkpoints  # noqa: E402
from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset  # noqa: E402
from trl_fp8.trainer import GRPOTrainer  # noqa: E402  (imports TRL and transformers in the parent)

SESSION_TIMEOUT_S = 600

COMMON = dict(use_cpu=True, bf16=False, learning_rate=5e-3, per_device_train_batch_size=8, num_generations=4,
              max_completion_length=6, logging_steps=1, save_strategy="steps", report_to="none", disable_tqdm=True,
              seed=7, gradient_checkpointing=False, max_steps=6, save_steps=2)
CONFIGS = {
    # TRL's own settings (every capability off); one generation feeds two steps, so checkpoint-3 falls between two
    # generations; eight prompts: an epoch is four steps, so the resumed run crosses into the second epoch
    "plain": dict(steps_per_generation=2, save_steps=3, num_prompts=8),
    "fair_cast_sr": dict(fair_cast="stochastic", save_total_limit=1),
    "fair_cast_ef": dict(fair_cast="error_feedback", num_prompts=8),  # checkpoint-4 ends the first epoch
    # four prompts: each comes back every other step, so the plan depends on what the controller learned
    "duet": dict(duet=True, duet_budget=0.5, max_completion_length=8, num_prompts=4),
    "mxfp8": dict(mxfp8=True, max_steps=4),
    "lora": dict(lora=True, save_total_limit=1),
}


def length_reward(completions, **kwargs):
    """Varies between rollouts, so every step has advantages and the weights move."""
    return [len(c if isinstance(c, str) else c[-1]["content"]) / 10 for c in completions]


def build_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_fp8.tokenization import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_trainer(config: str, model_dir: str, output_dir: str) -> GRPOTrainer:
    settings = {**COMMON, **CONFIGS[config]}
    num_prompts = settings.pop("num_prompts", 64)
    peft_config = None
    if settings.pop("lora", False):
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    args = trl_fp8.GRPOConfig(output_dir=output_dir, metrics_jsonl=os.path.join(output_dir, "metrics.jsonl"),
                              **settings)
    return GRPOTrainer(model=model_dir, reward_funcs=[length_reward], args=args,
                       train_dataset=make_arithmetic_dataset(num_prompts, seed=5), peft_config=peft_config)


# -- kill points --------------------------------------------------------------------------------------------------
def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(trainer: GRPOTrainer, point: str) -> None:
    from transformers import TrainerCallback

    kind, *rest = point.split(":")
    step = int(rest[0])
    if kind == "step":
        class KillInStep(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if state.global_step == step - 1:
                    _die()

        trainer.add_callback(KillInStep())
    elif kind == "gen":
        nth = int(rest[1])
        generate, seen = trainer._generate_single_turn, {"on": False, "forwards": 0}

        def hook(module, inputs):
            if seen["on"] and trainer.state.global_step == step - 1:
                seen["forwards"] += 1
                if seen["forwards"] == nth:
                    _die()

        def generating(*args, **kwargs):
            seen["on"] = True
            try:
                return generate(*args, **kwargs)
            finally:
                seen["on"] = False

        torch.nn.modules.module.register_module_forward_pre_hook(hook)
        trainer._generate_single_turn = generating
    elif kind == "save":
        where = rest[1]
        tmp_name = f"{checkpoints.TMP_PREFIX}checkpoint-{step}"

        def after(method_name):
            original = getattr(trainer, method_name)

            def wrapped(output_dir=None, *args, **kwargs):
                out = original(output_dir, *args, **kwargs)
                if os.path.basename(os.path.normpath(str(output_dir))) == tmp_name:
                    _die()
                return out

            setattr(trainer, method_name, wrapped)

        if where == "model":
            after("save_model")
        elif where == "optimizer":
            after("_save_optimizer_and_scheduler")
        elif where == "rng":
            after("_save_rng_state")
        elif where == "marker":
            commit = checkpoints.save.commit  # looked up in trl_fp8.checkpoints.save when a checkpoint is saved

            def before_marker(tmp, final):
                if os.path.basename(tmp) == tmp_name:
                    checkpoints.durable.sync_tree(tmp)  # every file written and synced, no marker
                    _die()
                return commit(tmp, final)

            checkpoints.save.commit = before_marker
        elif where == "rename":
            rename = os.rename

            def before_rename(src, dst, *args, **kwargs):
                if os.path.basename(str(src)) == tmp_name:
                    _die()
                return rename(src, dst, *args, **kwargs)

            os.rename = before_rename
        elif where == "rotate":
            rmtree = checkpoints.durable.shutil.rmtree

            def in_rotation(path, *args, **kwargs):
                if os.path.basename(str(path)).startswith(f"{checkpoints.TMP_PREFIX}deleting-") and \
                        trainer.state.global_step == step:
                    _die()
                return rmtree(path, *args, **kwargs)

            checkpoints.durable.shutil.rmtree = in_rotation
        else:
            raise ValueError(f"unknown save kill point {where!r}")
    else:
        raise ValueError(f"unknown kill point {point!r}")


# -- one session, in a child process ------------------------------------------------------------------------------
def session(config: str, model_dir: str, output_dir: str, kill: str | None) -> None:
    torch.set_num_threads(1)
    trainer = make_trainer(config, model_dir, output_dir)
    if kill is not None:
        install_kill(trainer, kill)
    trainer.train(resume_from_checkpoint="auto")
    final = {
        "global_step": trainer.state.global_step,
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "capabilities": {name: c.state_dict() for name, c in trainer.capabilities.items()},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }
    torch.save(final, os.path.join(output_dir, "final_state.pt"))


def run_child(fn, log_path: str, *args) -> int:
    """Fork, run ``fn(*args)`` in the child with its output to ``log_path``; the child's wait status: 0 on success,
    -SIGNAL when killed by a signal, else the exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code
        code = 1
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            fn(*args)
            code = 0
        except BaseException:  # noqa: BLE001 - reported in the log, the exit code tells the parent
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    signal.signal(signal.SIGALRM, lambda *a: os.kill(pid, signal.SIGKILL))
    signal.alarm(SESSION_TIMEOUT_S)
    _, status = os.waitpid(pid, 0)
    signal.alarm(0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def main(argv: list[str]) -> int:
    config, out, kills = argv[0], argv[1], argv[2:]
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(out, "model")
    result = {"config": config, "kills": kills, "model": run_child(build_model, os.path.join(out, "model.log"),
                                                                    model_dir)}
    result["reference"] = run_child(session, os.path.join(out, "reference.log"), config, model_dir,
                                    os.path.join(out, "reference"), None)
    killed = os.path.join(out, "killed")
    os.makedirs(killed, exist_ok=True)
    result["sessions"] = []
    for i, kill in enumerate([*kills, None]):
        status = run_child(session, os.path.join(out, f"session-{i}.log"), config, model_dir, killed, kill)
        result["sessions"].append({"kill": kill, "status": status,
                                   "checkpoints": sorted(os.listdir(killed))})
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
