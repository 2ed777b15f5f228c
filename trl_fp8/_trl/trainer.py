"""TRL's trainer internals: its per-mode metrics, its own generation and logprob paths, the generation call's extra
processors, the fused lm head."""

from __future__ import annotations

import contextlib
import functools

import torch
from trl import GRPOTrainer as TRLGRPOTrainer

from .. import distributed

# -- the trainer --------------------------------------------------------------------------------------------------
def record_metric(trainer, name: str, value: float) -> None:
    """Record into TRL's own per-mode metrics: ``GRPOTrainer.log`` averages them per logging step and sends them
    to every tracker (W&B, trackio, TensorBoard) and ``log_history``."""
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode][name].append(float(value))


def _loss_mask(output: dict) -> torch.Tensor:
    """The batch's loss mask as TRL 1.16 builds it: ``completion_mask`` times ``tool_mask`` when there is one."""
    mask = output["completion_mask"]
    return mask if output.get("tool_mask") is None else mask * output["tool_mask"]


def recount_items(trainer, output: dict) -> None:
    """Recount ``output["num_items_in_batch"]`` after a capability masked rows out of the loss. TRL 1.16 counts it in
    ``_generate_and_score_completions`` from ``completion_mask`` (times ``tool_mask``) summed over the processes,
    *before* returning the batch; it is the ``dapo`` loss's normaliser, so masked rows counted there would shrink
    every other row's gradient. A collective: every rank calls it."""
    output["num_items_in_batch"] = trainer.accelerator.gather(_loss_mask(output).sum()).sum()


# losses whose value is a sum over the batch's masked tokens divided by num_items_in_batch (TRL 1.16 _compute_loss): a
# row whose loss mask is all zero adds exactly nothing to them, so it can leave the batch
TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")


def drop_masked_rows(trainer, output: dict) -> tuple[dict, int]:
    """``output`` without the rows whose loss mask (``completion_mask`` times ``tool_mask``) is all zero, so the loss's
    forward and backward do not run on them, and how many rows were dropped. Exact for the losses in
    :data:`TOKEN_SUM_LOSSES` (the loss and its gradient are unchanged up to summation order); for any other
    ``loss_type`` (per-sequence or per-batch means) the batch is returned whole. Kept: at least
    ``steps_per_generation`` rows and a multiple of it (TRL splits the batch into that many equal micro-batches and
    drops a remainder), made up with masked rows, and with many processes the same number of rows on every rank
    (the largest any rank needs: TRL gathers per-row metrics); every per-row tensor is sliced alike. A batch holding
    anything else per row (a list, multimodal fields) is returned whole."""
    if trainer.loss_type not in TOKEN_SUM_LOSSES:
        return output, 0
    mask = _loss_mask(output)
    rows = mask.size(0)
    per_row = set()
    for key, value in output.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == rows:
            per_row.add(key)
        elif not (value is None or (isinstance(value, torch.Tensor) and value.dim() == 0)):
            return output, 0
    kept = (mask.sum(1) > 0).nonzero().flatten().tolist()
    chunks = max(1, int(trainer.args.steps_per_generation))
    size = max(chunks, -(-len(kept) // chunks) * chunks)
    # one size on every rank: TRL gathers per-row loss metrics across the processes (equal shapes). One all-gather,
    # reached by every rank: the batch's structure and the loss type that decide the early returns above are the
    # same on all of them.
    size = int(distributed.reduce_floats([size], ["max"], device=mask.device)[0])
    if size >= rows:
        return output, 0
    kept_set = set(kept)
    padding = [r for r in range(rows) if r not in kept_set][:size - len(kept)]
    index = torch.tensor(sorted(kept + padding), dtype=torch.long, device=mask.device)
    return {k: v.index_select(0, index.to(v.device)) if k in per_row else v for k, v in output.items()}, rows - size


def _reward_metric_names(trainer) -> list[str]:
    """The metrics TRL's ``_generate_and_score_completions`` derives from the rewards of one batch (trl 1.16)."""
    names = ["reward", "reward_std", "frac_reward_zero_std"]
    for name in trainer.reward_func_names:
        names += [f"rewards/{name}/mean", f"rewards/{name}/std"]
    return names


def drop_reward_metrics_of_last_batch(trainer) -> None:
    """Remove the reward statistics TRL just recorded for a batch whose every row a capability withheld (NaN: DUET
    sampled nothing): the logging window then averages the batches that did sample, and a window with none has no
    such key (TRL's ``log`` would write None there, which it does only when reward functions return None)."""
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for name in _reward_metric_names(trainer):
        values = metrics.get(name)
        if values:
            values.pop()
        if name in metrics and not metrics[name]:
            del metrics[name]


def trl_generate(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """TRL's own ``_generate_single_turn`` (bypassing trl_fp8's override)."""
    return TRLGRPOTrainer._generate_single_turn(trainer, prompt_ids, images, multimodal_fields, num_generations,
                                                has_tool_images)


def policy_logps(trainer, model, input_ids, attention_mask, logits_to_keep) -> torch.Tensor:
    """Per-token logprobs of the completion tokens under ``model``, computed as TRL computes the loss's."""
    return TRLGRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, attention_mask,
                                                            logits_to_keep)[0]


def num_beams(trainer) -> int:
    return int(getattr(trainer.generation_config, "num_beams", 1) or 1)


@contextlib.contextmanager
def generating_with(trainer, model=None, logits_processors=(), stopping_criteria=()):
    """Within TRL's transformers generation path: generate with ``model`` instead of the learner (when given), and
    pass extra logits processors / stopping criteria to its ``generate`` call (TRL offers no hook for either)."""
    learner = trainer.model_wrapped
    if model is not None:
        trainer.model_wrapped = model
    target = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    extra = {}
    if logits_processors:
        from transformers import LogitsProcessorList

        extra["logits_processor"] = LogitsProcessorList(list(logits_processors))
    if stopping_criteria:
        from transformers import StoppingCriteriaList

        extra["stopping_criteria"] = StoppingCriteriaList(list(stopping_criteria))
    if extra:
        target.generate = functools.partial(type(target).generate, target, **extra)
    try:
        yield target
    finally:
        trainer.model_wrapped = learner
        if extra:
            vars(target).pop("generate", None)


def repatch_fused_head(trainer, twin: torch.nn.Module) -> None:
    """Give a deep copy of the policy its own forward.

    TRL 1.16 patches the policy's ``forward`` (``add_fused_lm_head``) with a closure over the *original* bound
    forward. ``copy.deepcopy`` rebinds the method but not the closure, so the copy's forward would run the learner
    (its fp32 weights and, under gradient checkpointing in train mode, no KV cache: garbage generations). Drop the
    copied patch and apply TRL's patch to the copy itself.
    """
    from trl.trainer.utils import add_fused_lm_head

    if "forward" in vars(twin):
        del twin.forward
        add_fused_lm_head(twin, temperature=trainer.temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy"))


def patch_fused_head(trainer, policy: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Give a freshly built copy of the policy (not a deep copy) TRL's fused-head forward, as the policy has it."""
    from trl.trainer.utils import add_fused_lm_head

    if "forward" in vars(policy) and "forward" not in vars(twin):
        add_fused_lm_head(twin, temperature=trainer.temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy"))


def peft_config_argument(pargs: tuple, kwargs: dict):
    """The ``peft_config`` a ``GRPOTrainer(model, reward_funcs, args, *pargs, **kwargs)`` call passes (by keyword or
    by position, as TRL's signature places it), or None."""
    return _init_argument("peft_config", pargs, kwargs)


def quantization_config_argument(pargs: tuple, kwargs: dict):
    """The ``quantization_config`` a ``GRPOTrainer(...)`` call passes (by keyword or by position), or None."""
    return _init_argument("quantization_config", pargs, kwargs)


def _init_argument(name: str, pargs: tuple, kwargs: dict):
    import inspect

    from trl import GRPOTrainer

    if name in kwargs:
        return kwargs[name]
    names = list(inspect.signature(GRPOTrainer.__init__).parameters)[4:]  # after self, model, reward_funcs, args
    index = names.index(name) if name in names else None
    return pargs[index] if index is not None and index < len(pargs) else None


