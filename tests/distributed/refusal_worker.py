"""One rank of the multi-process refusal tests (``torchrun --nproc_per_node 2 refusal_worker.py OUT CASE[,CASE...]``),
run with the environment an accelerate config for FSDP2 or DeepSpeed ZeRO-3 sets (the test chooses it). Each case
asks for a capability that engine refuses and records, on every rank, where the refusal came and what it said, in
``OUT/<case>.rank<r>.json``: ``{"stage": "config" | "trainer", "error": "ValueError", "message": ..., "world": 2}``,
or ``{"stage": "ran", ...}`` when nothing was refused (the test then fails).

- ``config_<capability>``: ``trl_fp8.GRPOConfig`` with the capability asked for, under the engine: refused at once;
- ``trainer_<capability>``: the config made *before* the engine's environment appears (a notebook, a launcher that
  sets it late), the trainer made after: refused at trainer start;
- ``default_checks``: every field at its default (``fair_cast="off"``): admitted; records the lines the engine guard
  logged (``{"stage": "ran", "warnings": [...], "sync_checks": ...}``);
- ``zero3_peft_fair_cast``: Fair Cast over a LoRA model under ZeRO-3 (supported engine, refused combination): the
  trainer's set-up refuses it on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys

ENGINE_VARIABLES = ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE")
FIELDS = {"fair_cast": {"fair_cast": "stochastic"}, "duet": {"duet": True}, "mxfp8": {"mxfp8": True},
          "fast_qlora": {"fast_qlora": "on"}, "sync_checks": {"sync_checks": "all"}}


def _args(out: str, **fields):
    import trl_fp8

    base = dict(output_dir=os.path.join(out, "run"), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                num_generations=4, per_device_train_batch_size=4, max_completion_length=4, save_strategy="no")
    return trl_fp8.GRPOConfig(**{**base, **fields})


def _trainer(args, **kwargs):
    import trl_fp8
    from trl_fp8.app.demo.model import demo_model_path
    from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

    return trl_fp8.GRPOTrainer(model=demo_model_path(), reward_funcs=[correctness_reward], args=args,
                               train_dataset=make_arithmetic_dataset(8, seed=1), **kwargs)


def run_case(out: str, case: str) -> dict:
    stage = "config"
    try:
        if case.startswith("config_"):
            _args(out, **FIELDS[case.removeprefix("config_")])
        elif case.startswith("trainer_"):
            saved = {k: os.environ.pop(k) for k in ENGINE_VARIABLES if k in os.environ}
            try:
                args = _args(out, sync_checks="off", **FIELDS[case.removeprefix("trainer_")])
            finally:
                os.environ.update(saved)
            stage = "trainer"
            _trainer(args)
        elif case == "default_checks":
            lines = []
            handler = logging.Handler()
            handler.emit = lambda record: lines.append(f"{record.levelname}: {record.getMessage()}")
            logger = logging.getLogger("trl_fp8.distributed")
            level = logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            try:
                args = _args(out, fair_cast="off")
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            return {"stage": "ran", "warnings": lines, "sync_checks": args.sync_checks}
        elif case == "zero3_peft_fair_cast":
            from peft import LoraConfig

            args = _args(out, fair_cast="stochastic", sync_checks="off", bf16=True)
            stage = "trainer"
            _trainer(args, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        else:
            raise SystemExit(f"unknown case {case!r}")
    except ValueError as err:
        return {"stage": stage, "error": type(err).__name__, "message": str(err)}
    return {"stage": "ran"}


def main() -> int:
    out, cases = sys.argv[1], sys.argv[2].split(",")
    rank = int(os.environ.get("RANK", 0))
    for case in cases:
        record = run_case(out, case)
        record["world"] = int(os.environ.get("WORLD_SIZE", 1))
        with open(os.path.join(out, f"{case}.rank{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(record, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
