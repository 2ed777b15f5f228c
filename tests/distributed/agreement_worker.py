"""One rank of the rank-agreement tests (``torchrun --nproc_per_node 2 agreement_worker.py OUT SCENARIO MODEL``):
what one process reads from its own environment or disk must not make the ranks of a run disagree. Writes
``OUT/<scenario>.rank<r>.json``.

- ``budget``: ``TRL_FP8_TIME_BUDGET`` set on rank 0 only (a per-node environment): records the config's
  ``time_budget`` and whether the trainer runs the time budget;
- ``resume``: each rank's output_dir holds other checkpoints (node-local disks: rank 1's node lost checkpoint-2);
  records the checkpoint ``resume_from_checkpoint="auto"`` picks, or the error every rank raises.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _record(out: str, scenario: str, rank: int, **fields) -> None:
    with open(os.path.join(out, f"{scenario}.rank{rank}.json"), "w") as f:
        json.dump(fields, f)


def _config(out: str, name: str, **overrides):
    import trl_fp8

    kwargs = dict(output_dir=os.path.join(out, name), use_cpu=True, bf16=False, max_steps=2,
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=4, report_to="none",
                  disable_tqdm=True, save_strategy="no")
    kwargs.update(overrides)
    return trl_fp8.GRPOConfig(**kwargs)


def _trainer(args, model_dir):
    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                               args=args, train_dataset=make_arithmetic_dataset(16, seed=1))


def budget(out: str, model_dir: str) -> None:
    rank = int(os.environ["RANK"])
    if rank == 0:
        os.environ["TRL_FP8_TIME_BUDGET"] = "2h"
    else:
        os.environ.pop("TRL_FP8_TIME_BUDGET", None)
    args = _config(out, "budget")
    trainer = _trainer(args, model_dir)
    _record(out, "budget", rank, time_budget=args.time_budget, capabilities=sorted(trainer.capabilities))


def resume(out: str, model_dir: str) -> None:
    """Rank r trains in ``resume-r``: the same run seen through two node-local disks, rank 1's missing checkpoint-2."""
    from trl_fp8 import checkpoints

    rank = int(os.environ["RANK"])
    run = os.path.join(out, f"resume-{rank}")
    seed = os.path.join(out, "seed-run")  # written by the test: checkpoint-1 and checkpoint-2 of a 2-step run
    shutil.copytree(seed, run)
    if rank == 1:
        shutil.rmtree(os.path.join(run, "checkpoint-2"))
    args = _config(out, f"resume-{rank}", max_steps=3)
    trainer = _trainer(args, model_dir)
    try:
        chosen = checkpoints.prepare_resume(trainer, "auto")
    except ValueError as err:
        _record(out, "resume", rank, chosen=None, error=str(err))
        return
    _record(out, "resume", rank, chosen=None if chosen is None else os.path.basename(chosen), error=None)


def main(out: str, scenario: str, model_dir: str) -> None:
    torch.set_num_threads(1)
    {"budget": budget, "resume": resume}[scenario](out, model_dir)


if __name__ == "__main__":
    main(*sys.argv[1:4])
