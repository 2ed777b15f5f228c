"""Fair Cast under DeepSpeed: the refusals that need no DeepSpeed run (the ZeRO runs are tests/distributed)."""

from types import SimpleNamespace

import pytest
import torch

from trl_fp8.fair_cast.zero import ZeroFairCast


def _callback(tmp_path, mode="error_feedback", optimizer=None):
    engine = SimpleNamespace(optimizer=optimizer, module=torch.nn.Linear(2, 2))
    trainer = SimpleNamespace(model_wrapped=engine, args=SimpleNamespace(output_dir=str(tmp_path)))
    return ZeroFairCast(trainer, mode, torch.bfloat16, seed=1, record=lambda *a: None)


def test_an_engine_without_a_zero_optimizer_is_refused_naming_it(tmp_path):
    class AdamW:
        pass

    callback = _callback(tmp_path, optimizer=AdamW())
    with pytest.raises(ValueError, match="expects a ZeRO optimizer on the engine, found AdamW"):
        callback.on_train_begin(None, SimpleNamespace(global_step=0), None)


def test_an_ef_resume_without_the_ranks_files_names_the_checkpoint_passed_in(tmp_path):
    callback = _callback(tmp_path)
    moved = tmp_path / "elsewhere" / "checkpoint-2"
    moved.mkdir(parents=True)
    callback.rank_folder = str(moved)  # what load_process_files sets: the checkpoint being resumed
    with pytest.raises(ValueError, match=rf"needs each rank's fair_cast_state.rank0.pt .*looked in {moved}"):
        callback._load_rank_state(callback.trainer.args, 2)
