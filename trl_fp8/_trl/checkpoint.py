"""TRL's and transformers' checkpoint internals: writing a checkpoint's files, loading one, the generation buffer,
the data order of a resumed epoch."""

from __future__ import annotations

import os

import torch

# -- checkpoints ---------------------------------------------------------------------------------------------------
def write_checkpoint_files(trainer, folder: str, run_dir: str, trial) -> None:
    """Write into ``folder`` everything a checkpoint of ``trl.GRPOTrainer`` holds, as its ``_save_checkpoint`` writes
    it into ``<run_dir>/checkpoint-<step>`` — without the Hub push and the rotation of older checkpoints, which
    :func:`trl_fp8.checkpoints.save_checkpoint` runs once the folder is complete and in place.

    Mirrors trl 1.16 ``GRPOTrainer._save_checkpoint`` (model card, then transformers', then the adaptive-entropy
    controller's state) and transformers 5.19 ``Trainer._save_checkpoint`` (both fingerprinted in the contract test).
    Every process calls it (DeepSpeed/FSDP saves are collective; each process writes its RNG state).
    """
    import json
    from pathlib import Path

    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

    args, state = trainer.args, trainer.state
    # TRL: the model card, in output_dir
    model_name = Path(args.output_dir).name if args.hub_model_id is None else args.hub_model_id.split("/")[-1]
    trainer.create_model_card(model_name=model_name)
    # transformers
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    trainer.save_model(folder, _internal_call=True)
    if args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and state.best_global_step:
        trainer.accelerator.wait_for_everyone()  # transformers: the model is saved by process 0 before the check
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        # the checkpoint being written is the best one: it is in place once renamed (transformers checks the folder,
        # which it writes in place)
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best
    if not args.save_only_model:
        trainer._save_optimizer_and_scheduler(folder)
        trainer._save_scaler(folder)
        trainer._save_rng_state(folder)
    if args.should_save:
        for cb in [cb for cb in trainer.callback_handler.callbacks + [trainer.control]
                   if isinstance(cb, ExportableState)]:
            cb_name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(state.stateful_callbacks[cb_name], list):
                state.stateful_callbacks[cb_name].append(cb_state)
            else:
                state.stateful_callbacks[cb_name] = cb_state
        state.save_to_json(os.path.join(folder, "trainer_state.json"))
    # TRL: the adaptive-entropy controller
    if trainer.use_adaptive_entropy and args.should_save:
        with open(os.path.join(folder, "entropy_ctrl_state.json"), "w") as f:
            json.dump({"entropy_coef": trainer.entropy_coef, "last_world_entropy": trainer._last_world_entropy}, f)


def run_dir(trainer, trial=None) -> str:
    """The folder checkpoints go to (``output_dir``, or a hyperparameter-search trial's folder)."""
    return trainer._get_output_dir(trial=trial)


def load_model_from_checkpoint(trainer, folder: str) -> None:
    """transformers' loading of a checkpoint's weights (full model, sharded, or PEFT adapters) into the model, as
    ``Trainer.train`` does it before training."""
    trainer._load_from_checkpoint(folder)


def push_checkpoint(trainer, folder: str) -> None:
    """transformers' push of a checkpoint folder to the Hub (``args.push_to_hub``), as its ``_save_checkpoint`` runs
    it."""
    trainer._push_from_checkpoint(folder)


def generation_buffer(trainer) -> dict | None:
    """TRL's generation buffer when a checkpoint falls between two generations, else None.

    TRL generates once per ``steps_per_generation × num_iterations`` micro-steps and feeds the micro-batches from
    ``_buffered_inputs`` (picked by ``_step``). A checkpoint taken between two generations without it resumes by
    generating afresh (TRL's own resume does): a different batch, not the run it would have been."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    if trainer._buffered_inputs is None or trainer._step % generate_every == 0:
        return None
    return {"step": int(trainer._step), "buffered_inputs": trainer._buffered_inputs}


def advance_train_sampler(sampler, epochs: int) -> None:
    """Bring TRL's ``RepeatSampler`` to where it is at the start of epoch ``epochs`` of an uninterrupted run.

    Its generator is seeded once, when the sampler is built, and each epoch draws the next permutation from it; a
    resumed session builds a new sampler, so without this every resumed epoch would replay epoch 0's order (the
    data of the uninterrupted run from the second epoch on is not what a resumed run sees)."""
    from trl.trainer.utils import RepeatSampler

    if not isinstance(sampler, RepeatSampler) or not sampler.shuffle:
        return
    for _ in range(int(epochs)):
        torch.randperm(sampler.num_samples, generator=sampler.generator)


def restore_generation_buffer(trainer, state: dict) -> None:
    trainer._step = int(state["step"])
    trainer._buffered_inputs = state["buffered_inputs"]
