"""One data-parallel training session (launched by ``torchrun --nproc_per_node 2``) that resumes with
``resume_from_checkpoint="auto"``; the main process writes the final weights to OUT_DIR/final.pt.

usage: torchrun --standalone --nproc_per_node 2 ddp_session.py OUT_DIR MODEL_DIR MAX_STEPS [each_node]
(``each_node``: ``save_on_each_node=True``; with ``--nnodes 2``, two single-process "nodes" on one machine: shared
storage. It also saves the final model into OUT_DIR/final_model and writes OUT_DIR/savers-<rank>.json: how often each
process ran the start's clean-up and which folders it wrote as a saver.)"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kill_runner  # noqa: E402  (environment, model and reward shared with the kill matrix)

import trl_fp8  # noqa: E402
from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset  # noqa: E402


def record_savers(trainer, out: str) -> dict:
    """Record, per process, the clean-ups run at start and the folders written as a saver (``args.should_save``
    while ``save_model`` writes): OUT_DIR/savers-<rank>.json, written at the end."""
    from trl_fp8.checkpoints import resume

    seen = {"clean_stale": 0, "saved_as_saver": []}
    clean_stale, save_model = resume.clean_stale, trainer.save_model

    def counting(run_dir):
        seen["clean_stale"] += 1
        return clean_stale(run_dir)

    def saving(output_dir=None, *args, **kwargs):
        if trainer.args.should_save:
            seen["saved_as_saver"].append(os.path.basename(os.path.normpath(str(output_dir))))
        return save_model(output_dir, *args, **kwargs)

    resume.clean_stale, trainer.save_model = counting, saving
    return seen


def main(out: str, model_dir: str, max_steps: int, each_node: bool = False) -> None:
    torch.set_num_threads(1)
    args = trl_fp8.GRPOConfig(save_on_each_node=each_node,
        output_dir=out, metrics_jsonl=os.path.join(out, "metrics.jsonl"), max_steps=max_steps, save_steps=1,
        save_total_limit=2, per_device_train_batch_size=4, steps_per_generation=2,
        **{k: v for k, v in kill_runner.COMMON.items() if k not in ("max_steps", "save_steps",
                                                                     "per_device_train_batch_size")})
    trainer = trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[kill_runner.length_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(16, seed=5))
    seen = record_savers(trainer, out) if each_node else None
    trainer.train(resume_from_checkpoint="auto")
    if each_node:  # the final model too, atomically (trl-fp8 grpo's last save)
        from trl_fp8.checkpoints import save_final_model

        save_final_model(trainer, os.path.join(out, "final_model"))
        with open(os.path.join(out, f"savers-{trainer.args.process_index}.json"), "w") as f:
            json.dump(seen, f)
    if trainer.accelerator.is_main_process:
        torch.save(dict(trainer.model.state_dict()), os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4 and sys.argv[4] == "each_node")
