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


CASES = [final_save_refused_on_the_saver, stopped_save_decided_together]


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
