"""One rank of a 2-process (gloo, CPU) check that the save path's decisions are taken by every rank together.

usage: python -m torch.distributed.run --nproc_per_node 2 save_agreement_worker.py OUT_DIR
Writes OUT_DIR/rank<r>.json: what each case did on that rank."""

import datetime
import json
import os
import socket
import sys
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist


def _fake_trainer(rank: int, saved: list):
    args = SimpleNamespace(should_save=rank == 0, save_on_each_node=False, world_size=2, process_index=rank,
                           push_to_hub=False, save_total_limit=None)
    return SimpleNamespace(args=args, accelerator=SimpleNamespace(wait_for_everyone=dist.barrier),
                           save_model=lambda output_dir: saved.append(output_dir))


def final_save_refused_on_the_saver(out: str, rank: int) -> dict:
    """Rank 0 (the only saver) finds a live process's _tmp-final-model: every rank must raise, none may hang."""
    from trl_fp8.checkpoints import save, staging

    output_dir = os.path.join(out, "final")
    if rank == 0:
        tmp = os.path.join(output_dir, "_tmp-final-model")
        os.makedirs(tmp)
        with open(os.path.join(tmp, "trl_fp8_owner.json"), "w") as f:  # the launcher: alive, this host and namespace
            json.dump({"pid": os.getppid(), "host": socket.gethostname(), "started": None,
                       "pid_ns": staging._pid_namespace(), "boot_id": staging._boot_id()}, f)
    dist.barrier()
    saved = []
    try:
        save.save_final_model(_fake_trainer(rank, saved), output_dir)
    except Exception as err:  # noqa: BLE001 - reported
        return {"raised": type(err).__name__, "message": str(err), "saved": saved}
    return {"raised": None, "saved": saved}


def stopped_save_decided_together(out: str, rank: int) -> dict:
    """Rank 0 sees step N saved, rank 1 does not: both take one decision."""
    from trl_fp8.checkpoints import save

    return {"save": save.any_process(rank == 1)}


def final_save_fails_on_the_saver(out: str, rank: int) -> dict:
    """Rank 0's save_model fails (a full disk) after rank 1 has done its part: rank 1 must not wait in a barrier."""
    import errno

    from trl_fp8.checkpoints import save

    trainer = _fake_trainer(rank, [])
    if rank == 0:
        def full(output_dir):
            raise OSError(errno.ENOSPC, "No space left on device", output_dir)
        trainer.save_model = full
    try:
        save.save_final_model(trainer, os.path.join(out, "final_full_disk"))
    except Exception as err:  # noqa: BLE001 - reported
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None}


def checkpoint_commit_fails_on_the_saver(out: str, rank: int) -> dict:
    """The committing rank's fsync fails (EIO) in commit: every rank raises, the checkpoint is not there."""
    import errno

    from trl_fp8 import _trl
    from trl_fp8.checkpoints import save

    def eio(tmp, final):
        raise OSError(errno.EIO, "Input/output error", tmp)

    save.commit = eio
    save.settings_of = lambda args: {}
    _trl.write_checkpoint_files = lambda trainer, tmp, run_dir, trial: os.makedirs(tmp, exist_ok=True)
    _trl.generation_buffer = lambda trainer: None
    trainer = _fake_trainer(rank, [])
    trainer.capabilities = {}
    run_dir = os.path.join(out, "run")
    tmp, final = os.path.join(run_dir, "_tmp-checkpoint-3"), os.path.join(run_dir, "checkpoint-3")
    try:
        save._stage(trainer, None, trainer.args, run_dir, tmp, final, rank == 0, {}, "checkpoint checkpoint-3")
    except Exception as err:  # noqa: BLE001 - reported
        return {"raised": type(err).__name__, "message": str(err), "final": os.path.exists(final)}
    return {"raised": None, "final": os.path.exists(final)}


CASES = [final_save_refused_on_the_saver, stopped_save_decided_together, final_save_fails_on_the_saver,
         checkpoint_commit_fails_on_the_saver]


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    record = {}
    for case in CASES:
        try:
            record[case.__name__] = case(out, rank)
        except Exception:  # noqa: BLE001 - a timeout of a collective: the ranks disagreed
            record[case.__name__] = {"crashed": traceback.format_exc()[-2000:]}
            break
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
