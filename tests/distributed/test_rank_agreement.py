"""What one process reads from its own environment or disk must not make the ranks of a run disagree
(``torchrun --nproc_per_node 2``, gloo on CPU; ``agreement_worker.py``): the time budget from
``TRL_FP8_TIME_BUDGET``, and the checkpoint ``resume_from_checkpoint="auto"`` picks."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "agreement_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out, scenario, model_dir, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                 "TRL_FP8_TIME_BUDGET"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), WORKER, str(out),
                             scenario, model_dir], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:  # a hang: stop torchrun and its workers, then fail
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        raise AssertionError(f"torchrun did not finish in {timeout} s (a hang):\n{log[-4000:]}") from None
    assert proc.returncode == 0, log[-4000:]
    return [json.load(open(os.path.join(out, f"{scenario}.rank{r}.json"))) for r in range(2)]


def test_time_budget_from_the_environment_is_rank_0s_on_every_rank(tmp_path, tiny_model_dir):
    """TRL_FP8_TIME_BUDGET set in rank 0's environment only: every rank runs the budget (before, rank 1 ran without
    it, and the budget's all-reduces met no partner)."""
    a, b = _torchrun(tmp_path, "budget", tiny_model_dir)
    assert a == b, (a, b)
    assert a["time_budget"] == "2h" and "time_budget" in a["capabilities"]


def test_every_rank_resumes_from_rank_0s_choice_or_all_refuse(tmp_path, tiny_model_dir):
    """resume_from_checkpoint="auto" where rank 1 sees other checkpoints than rank 0 (node-local disks; rank 1's node
    lost checkpoint-2): every rank takes rank 0's choice, and since rank 1 cannot load it every rank raises the same
    error (before, rank 0 resumed from checkpoint-2 and rank 1 from checkpoint-1: replicas at different steps)."""
    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    args = trl_fp8.GRPOConfig(output_dir=str(tmp_path / "seed-run"), use_cpu=True, bf16=False, max_steps=2,
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                              report_to="none", disable_tqdm=True, save_strategy="steps", save_steps=1)
    trl_fp8.GRPOTrainer(model=tiny_model_dir, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                        args=args, train_dataset=make_arithmetic_dataset(16, seed=1)).train()
    a, b = _torchrun(tmp_path, "resume", tiny_model_dir)
    assert a == b, (a, b)
    assert a["chosen"] is None and "checkpoint-2" in a["error"] and "rank 1" in a["error"], a
