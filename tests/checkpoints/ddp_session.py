"""One data-parallel training session (launched by ``torchrun --nproc_per_node 2``) that resumes with
``resume_from_checkpoint="auto"``; the main process writes the final weights to OUT_DIR/final.pt.

usage: torchrun --standalone --nproc_per_node 2 ddp_session.py OUT_DIR MODEL_DIR MAX_STEPS [each_node]
(``each_node``: ``save_on_each_node=True``, for two single-process "nodes" on one machine: shared storage)"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kill_runner  # noqa: E402  (environment, model and reward shared with the kill matrix)

import trl_fp8  # noqa: E402
from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset  # noqa: E402


def main(out: str, model_dir: str, max_steps: int, each_node: bool = False) -> None:
    torch.set_num_threads(1)
    args = trl_fp8.GRPOConfig(save_on_each_node=each_node,
        output_dir=out, metrics_jsonl=os.path.join(out, "metrics.jsonl"), max_steps=max_steps, save_steps=1,
        save_total_limit=2, per_device_train_batch_size=4, steps_per_generation=2,
        **{k: v for k, v in kill_runner.COMMON.items() if k not in ("max_steps", "save_steps",
                                                                     "per_device_train_batch_size")})
    trainer = trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[kill_runner.length_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(16, seed=5))
    trainer.train(resume_from_checkpoint="auto")
    if trainer.accelerator.is_main_process:
        torch.save(dict(trainer.model.state_dict()), os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4 and sys.argv[4] == "each_node")
