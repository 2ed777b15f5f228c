"""One training session whose first checkpoint save pauses mid-write: it creates READY once the model is written
into the staging folder and waits there until GO exists (at most 300 s), then finishes. Stands for a job still
writing its checkpoint (e.g. a terminating pod in its SIGTERM grace) while another job starts on the same folder.

usage: python paused_save.py OUT_DIR MODEL_DIR READY GO"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kill_runner  # noqa: E402  (environment, model and reward shared with the kill matrix)

import torch  # noqa: E402

import trl_fp8  # noqa: E402
from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset  # noqa: E402


def main(out: str, model_dir: str, ready: str, go: str) -> None:
    torch.set_num_threads(1)
    args = trl_fp8.GRPOConfig(output_dir=out, **{**kill_runner.COMMON, "max_steps": 1, "save_steps": 1})
    trainer = trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[kill_runner.length_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(16, seed=5))
    save_model = trainer.save_model

    def paused(output_dir=None, *a, **kw):
        result = save_model(output_dir, *a, **kw)
        if os.path.basename(os.path.normpath(str(output_dir))).startswith("_tmp-checkpoint-"):
            open(ready, "w").close()
            deadline = time.monotonic() + 300
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
        return result

    trainer.save_model = paused
    trainer.train()


if __name__ == "__main__":
    main(*sys.argv[1:5])
