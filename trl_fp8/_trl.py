"""Every TRL-, transformers- and vLLM-private name trl_fp8 touches, in one place.

Nothing else in trl_fp8 reaches into a private method, an undocumented attribute or a module global of TRL or
vLLM: it calls a function here. One exception by design: :class:`trl_fp8.samplers.VLLMColocateSampler` is the
adapter of a vLLM engine's *layers* (``packed_modules_mapping``, ``output_sizes``, ``quant_method``,
``input_size_per_partition``) and reads them itself; the real-engine tests (``tests/sync/test_vllm_engine.py``)
exercise every one of them. ``tests/test_trl_contract.py`` pins what this module relies on — the signatures of
the TRL methods trl_fp8 overrides or calls, the trainer attributes it reads, and a fingerprint (hash of the
source) of each TRL code block whose *internals* it depends on — so a TRL upgrade fails with the list of what
moved instead of a silent change. Tested with the TRL range in :data:`TESTED_TRL`.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from trl import GRPOTrainer as TRLGRPOTrainer

TESTED_TRL = ">=1.16,<1.17"

# trl.GRPOTrainer methods trl_fp8.GRPOTrainer overrides (each calls TRL's own), with TRL's parameter names.
OVERRIDDEN = {
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields", "num_generations",
                              "has_tool_images"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_compute_loss": ("self", "model", "inputs"),
    "_get_per_token_logps_and_entropies": ("self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                           "batch_size", "compute_entropy", "compute_aux_loss", "pixel_values",
                                           "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                                           "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
                                           "image_position_ids"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),  # transformers' (public)
    "_get_train_sampler": ("self", "dataset"),  # kept, so that a resume can bring it to the resumed epoch
    "end": ("self",),  # transformers' Trainer.end (public): a colocated vLLM engine is shut down first
}
# Private attributes and methods of a constructed trl.GRPOTrainer that trl_fp8 reads or calls.
TRAINER_ATTRIBUTES = (
    "_metrics", "_tokenizer", "model_wrapped", "use_vllm", "vllm_mode",
    "use_transformers_continuous_batching", "temperature", "num_generations", "max_completion_length",
    "eos_token_ids", "pad_to_multiple_of", "generation_config", "generation_kwargs", "tools", "rollout_func",
    "environment_factories", "ref_model", "is_deepspeed_enabled", "is_fsdp_enabled", "compute_loss_context_manager",
    "_get_output_dir", "reward_func_names",
    # checkpoints (trl_fp8.checkpoints, through write_checkpoint_files / generation_buffer below)
    "_save_optimizer_and_scheduler", "_save_scaler", "_save_rng_state", "_push_from_checkpoint", "_load_from_checkpoint",
    "hp_search_backend",
    "use_adaptive_entropy", "entropy_coef", "_last_world_entropy", "num_iterations", "_step", "_buffered_inputs",
)
# ... and those set only with use_vllm=True (on the trainer, then on its VLLMGeneration).
VLLM_ATTRIBUTES = {
    "GRPOTrainer": ("vllm_generation",),
    "VLLMGeneration": ("mode", "llm", "vllm_client", "accelerator",
                       # DUET's requests are built with TRL's sampling settings (vllm_sampling_kwargs)
                       "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_completion_length",
                       "logprobs", "generation_kwargs", "structured_outputs_regex"),
}
# TRL code whose internals trl_fp8 depends on (not just its signature) -> why. The contract test hashes each.
MIRRORED = {
    "trl.trainer.grpo_trainer.GRPOTrainer._generate_single_turn":
        "generation runs model_wrapped.generate(**inputs, generation_config=...) through "
        "unwrap_model_for_generation: the swapped model and the injected processors/criteria reach it; the vLLM "
        "branch syncs weights, then calls self.vllm_generation.generate(prompts=, images=, num_generations=, "
        "profiler=) and keeps lp[0] of each token's logprobs (replacing_vllm_generate answers that call for DUET)",
    "trl.generation.vllm_generation.VLLMGeneration.generate":
        "colocate builds SamplingParams from n=1, repetition_penalty, temperature, top_p, top_k, min_p, max_tokens, "
        "logprobs, then generation_kwargs, then structured outputs (vllm_sampling_kwargs mirrors it for DUET)",
    "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss":
        "its first _get_per_token_logps_and_entropies call is the policy's forward on the batch",
    "trl.trainer.grpo_trainer.GRPOTrainer.log": "averages and clears self._metrics[mode] (our metrics sink)",
    "trl.trainer.utils.add_fused_lm_head": "patches forward with a closure over the original bound forward",
    "trl.generation.vllm_generation.VLLMGeneration._iter_named_params": "the stream a sync sends (names, tensors)",
    "trl.generation.vllm_generation.VLLMGeneration.sync_weights":
        "streams _iter_named_params() into load_weights / the client, then resets the prefix cache",
    "transformers.trainer.Trainer._save_checkpoint":
        "write_checkpoint_files mirrors what it writes (model, best-checkpoint record, optimizer, scheduler, scaler, "
        "RNG, trainer state with stateful callbacks) into a temporary folder; push and rotation run after the rename",
    "transformers.trainer.Trainer._push_from_checkpoint":
        "uploads output_dir in the background with ignore_patterns ['_*', 'checkpoint-*']: the _tmp-* folders "
        "trl_fp8 writes, replaces and deletes in (trl_fp8.checkpoints.TMP_PREFIX) stay out of it",
    "trl.trainer.grpo_trainer.GRPOTrainer._save_checkpoint":
        "model card in output_dir first, then transformers' checkpoint, then entropy_ctrl_state.json (mirrored)",
    "trl.trainer.grpo_trainer.GRPOTrainer._prepare_inputs":
        "one generation feeds steps_per_generation micro-batches kept in _buffered_inputs, picked by _step; "
        "a checkpoint between generations saves both (generation_buffer)",
    "trl.trainer.utils.RepeatSampler.__iter__":
        "each epoch (one __iter__) draws one randperm(num_samples) from the sampler's own generator when shuffle; "
        "a resume in epoch e draws e first (advance_train_sampler), or it would replay epoch 0's order",
    "trl.generation.vllm_generation.VLLMGeneration._init_vllm":
        "colocate builds the engine by calling the module global LLM with keyword arguments, "
        "quantization='bitsandbytes' for a 4-bit policy and no dtype (plain_cpu_linears, dense_engine and engine_dtype "
        "rewrite them)",
    "transformers.trainer.Trainer._maybe_log_save_evaluate":
        "log, then evaluate, then _save_checkpoint followed by on_save: the time budget measures a save from the last "
        "event before it (step end, on_log or on_evaluate) to on_save",
}
# Module globals of other packages that trl_fp8 patches (only inside plain_cpu_linears and dense_engine, while TRL
# builds its engine; restored after).
PATCHED_GLOBALS = (
    "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
    "trl.generation.vllm_generation.LLM",
)


# -- the trainer --------------------------------------------------------------------------------------------------
def record_metric(trainer, name: str, value: float) -> None:
    """Record into TRL's own per-mode metrics: ``GRPOTrainer.log`` averages them per logging step and sends them
    to every tracker (W&B, trackio, TensorBoard) and ``log_history``."""
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode][name].append(float(value))


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


# -- TRL's command line --------------------------------------------------------------------------------------------
def resolve_accelerate_config(args: list[str]) -> list[str]:
    """``--accelerate_config NAME`` resolved as ``trl grpo`` resolves it (TRL's named configs or a file)."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    return resolve_accelerate_config_argument(args)


def subtract_subsequence(sequence: list[str], subsequence: list[str]) -> list[str]:
    """What ``trl grpo`` uses to split its arguments between the script and ``accelerate launch``."""
    from trl.cli.commands.training import _subtract_subsequence

    return _subtract_subsequence(sequence, subsequence)


# -- TRL's vLLM generation ----------------------------------------------------------------------------------------
def trl_vllm_stream(generation):
    """TRL's own sync stream ``(vLLM name, tensor)`` of the learner's parameters (PEFT merged, names fixed)."""
    from trl.generation.vllm_generation import VLLMGeneration

    return VLLMGeneration._iter_named_params(generation)


def vllm_name(generation, name: str) -> str:
    """A learner parameter name as TRL's sync names it for vLLM."""
    return generation._fix_param_name_to_vllm(name)


def set_vllm_stream(generation, stream) -> None:
    """Make TRL's ``sync_weights`` stream ``stream()`` (an iterable of ``(vLLM name, tensor)``) on this instance."""
    generation._iter_named_params = stream


def wrap_vllm_sync(generation, around) -> None:
    """Wrap TRL's ``sync_weights`` on this instance: ``around(run)`` is called for each sync, and ``run(tap)`` runs
    TRL's sync with its stream passed through ``tap`` (an iterable -> iterable)."""
    original = generation.sync_weights

    def run(tap):
        had_override = "_iter_named_params" in vars(generation)
        stream = generation._iter_named_params
        generation._iter_named_params = lambda: tap(stream())
        try:
            original()
        finally:
            if had_override:
                generation._iter_named_params = stream
            else:
                del generation._iter_named_params

    generation.sync_weights = lambda: around(run)


def vllm_engine_dtype(generation) -> str | None:
    """The dtype name a TRL vLLM engine computes in (colocate: its model config; server: its info endpoint, read
    on the main process), or None where it cannot be read."""
    from .numerics import dtype_name

    if generation.mode == "colocate":
        config = getattr(getattr(generation.llm, "llm_engine", None), "model_config", None)
        return dtype_name(config.dtype) if config is not None else None
    if generation.accelerator.is_main_process:
        return dtype_name(generation.vllm_client.get_server_info()["model_config"]["dtype"])
    return None


@contextlib.contextmanager
def replacing_vllm_generate(generation, generate):
    """While active, TRL's ``generation.generate`` (what the vLLM branch of ``_generate_single_turn`` calls, after its
    weight sync) is ``generate(prompts, images, num_generations)`` on this instance, returning ``(completion_ids,
    logprobs)`` with one sampling logprob (or None: not available) per completion token. Adapted here to TRL's
    ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)`` with ``(rows, tokens, 1)`` logprobs: the branch keeps
    ``lp[0]`` of each token, and maps None to NaN (no importance-sampling correction on that token)."""

    def replaced(prompts, images, num_generations, profiler=None):
        with profiler or contextlib.nullcontext():
            completion_ids, logprobs = generate(prompts, images, num_generations)
        if logprobs is not None:
            logprobs = [[[lp] for lp in row] for row in logprobs]
        return prompts, completion_ids, logprobs, None

    own = vars(generation).get("generate")  # an instance-level generate set by someone else comes back after
    generation.generate = replaced
    try:
        yield
    finally:
        if own is None:
            del generation.generate
        else:
            generation.generate = own


def vllm_sampling_kwargs(generation) -> dict:
    """The ``SamplingParams`` keyword arguments TRL's colocate ``generate`` builds (sampling settings, then the
    user's ``generation_kwargs``, then structured outputs), as a dict to adjust."""
    kwargs = {"n": 1, "repetition_penalty": generation.repetition_penalty, "temperature": generation.temperature,
              "top_p": generation.top_p, "top_k": generation.top_k,
              "min_p": 0.0 if generation.min_p is None else generation.min_p,
              "max_tokens": generation.max_completion_length, "logprobs": generation.logprobs}
    kwargs.update(generation.generation_kwargs)
    if generation.structured_outputs_regex is not None or isinstance(kwargs.get("structured_outputs"), dict):
        from vllm.sampling_params import StructuredOutputsParams

        if generation.structured_outputs_regex is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(regex=generation.structured_outputs_regex)
        else:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return kwargs


def vllm_delta_params(kwargs: dict, logprobs: int):
    """``SamplingParams(**kwargs)`` for one rollout per request (``n=1``) that streams each step's new tokens
    (``RequestOutputKind.DELTA``) with at least ``logprobs`` top logprobs besides the sampled token's."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = {**kwargs, "n": 1, "logprobs": max(logprobs, kwargs.get("logprobs") or 0),
              "output_kind": RequestOutputKind.DELTA}
    return SamplingParams(**kwargs)


def vllm_add_request(llm, request_id: str, prompt_ids: list[int], params) -> None:
    """Queue one request on a colocated engine without running it (``LLM.generate`` would run every request to
    the end, and forces final-only outputs)."""
    llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)


def vllm_step(llm) -> list:
    """One engine step: the ``RequestOutput`` of every request that produced something."""
    return llm.llm_engine.step()


def vllm_abort(llm, request_ids: list[str]) -> None:
    """Abort requests (by the ids they were added with) between two steps: they generate nothing more."""
    if request_ids:
        llm.llm_engine.abort_request(list(request_ids))


# -- vLLM engine internals (colocate) -----------------------------------------------------------------------------
def vllm_model(llm) -> torch.nn.Module:
    """The torch model inside a colocated ``vllm.LLM`` (where TRL's colocate sync loads weights)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def vllm_weight_version(llm):
    return llm.llm_engine.get_weight_version()


def set_vllm_weight_version(llm, step: int) -> None:
    llm.llm_engine.set_weight_version(str(int(step)))


def vllm_cached_blocks(llm) -> int | None:
    """Prefix-cache blocks a colocated engine holds, or None where this engine layout does not expose them."""
    try:
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        return len(pool.cached_block_hash_to_block._cache)
    except AttributeError:
        return None


@contextlib.contextmanager
def plain_cpu_linears(enforce_eager: bool = True):
    """While active, vLLM-CPU engines built in this process keep plain linear weights (and, by default, skip
    torch.compile: ``enforce_eager=True`` starts a small engine in ~3 s instead of ~18 s).

    TRL 1.16 syncs colocate weights with ``model.load_weights([(name, tensor)])``. On vLLM-CPU this raises halfway
    (``'Parameter' object has no attribute 'weight_loader'``): after loading, vLLM-CPU repacks every linear weight
    into a oneDNN handle and deletes the parameter, and the tied ``lm_head`` computes with a packed copy of the
    embedding taken at load time. Here the linear layers compute with their live parameters
    (``torch.nn.functional.linear``) so TRL's own sync writes exactly what the engine computes with.
    """
    import trl.generation.vllm_generation as trl_vllm
    import vllm.model_executor.layers.utils as layer_utils

    def plain(layer, remove_weight):  # the vLLM-CPU fallback kernel, chosen for every dense layer
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    original_dispatch, original_llm = layer_utils.dispatch_cpu_unquantized_gemm, trl_vllm.LLM

    def llm(*args, **kwargs):
        if enforce_eager:
            kwargs.setdefault("enforce_eager", True)
        return original_llm(*args, **kwargs)

    layer_utils.dispatch_cpu_unquantized_gemm = plain
    trl_vllm.LLM = llm
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original_dispatch
        trl_vllm.LLM = original_llm


def vllm_platform_is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


@contextlib.contextmanager
def dense_engine():
    """While active, a colocated engine TRL builds for a 4-bit policy is started without TRL's
    ``quantization="bitsandbytes"``: it loads the checkpoint's 16-bit weights, and fast QLoRA sends it
    ``dequant(W) + ΔW`` in that dtype (see :mod:`trl_fp8.qlora.vllm`)."""
    def rewrite(kwargs):
        if kwargs.get("quantization") == "bitsandbytes":
            kwargs["quantization"] = None

    with _rewriting_llm(rewrite):
        yield


@contextlib.contextmanager
def engine_dtype(dtype: str):
    """While active, a colocated engine TRL builds is started with ``dtype=dtype`` (TRL passes none, so vLLM takes the
    checkpoint's, e.g. bf16, which it refuses below compute capability 8.0): ``precision`` chose fp16."""
    with _rewriting_llm(lambda kwargs: kwargs.setdefault("dtype", dtype)):
        yield


@contextlib.contextmanager
def _rewriting_llm(rewrite):
    """While active, TRL's module-global ``LLM`` (what ``_init_vllm`` builds a colocated engine with) is called with
    its keyword arguments passed through ``rewrite(kwargs)`` first; restored after."""
    import trl.generation.vllm_generation as trl_vllm

    original_llm = trl_vllm.LLM

    def llm(*args, **kwargs):
        rewrite(kwargs)
        return original_llm(*args, **kwargs)

    trl_vllm.LLM = llm
    try:
        yield
    finally:
        trl_vllm.LLM = original_llm


def vllm_engine_quantization(generation) -> str | None:
    """The quantization a TRL vLLM engine was started with (colocate: its model config; server: its info endpoint,
    read on the main process); None: none, or not readable here."""
    if generation.mode == "colocate":
        config = getattr(getattr(generation.llm, "llm_engine", None), "model_config", None)
        return getattr(config, "quantization", None)
    if generation.accelerator.is_main_process:
        return generation.vllm_client.get_server_info()["model_config"].get("quantization")
    return None


@contextlib.contextmanager
def engine_context(args, capabilities=()):
    """The context TRL's vLLM engine must be built in: plain linears on a vLLM-CPU colocate engine; what each
    capability declares (:meth:`Capability.engine_context`, e.g. fast QLoRA's dense engine); ``dtype="half"`` when
    ``precision`` chose fp16 (a T4)."""
    from .composition import engine_contexts
    from .precision import vllm_dtype

    with contextlib.ExitStack() as stack:
        if args is not None and getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate":
            if vllm_platform_is_cpu():
                stack.enter_context(plain_cpu_linears())
            stack.enter_context(engine_contexts(capabilities, args))
            dtype = vllm_dtype(args)
            if dtype is not None:
                stack.enter_context(engine_dtype(dtype))
        yield


# -- shutting a colocated engine down -----------------------------------------------------------------------------
# Shut a colocated vLLM engine down while the process group it was built on still exists.
#
# In colocate mode TRL builds ``vllm.LLM(..., distributed_executor_backend="external_launcher")`` in the training
# process. vLLM then holds its own process groups (tensor/pipeline/data-parallel ``GroupCoordinator``s, sub-groups
# of torch.distributed's default group) and registers ``weakref.finalize(client, engine_core.shutdown)`` on its
# in-process engine client. That finalizer runs at interpreter exit and tears the groups down
# (``cleanup_dist_env_and_memory`` -> ``destroy_model_parallel`` -> ``torch.distributed.destroy_process_group(group)``).
#
# When the script has already destroyed the default group (``Trainer.end()`` -> ``Accelerator.end_training()`` ->
# ``torch.distributed.destroy_process_group()``, which drops every sub-group from torch's registry), the finalizer
# asks torch to destroy groups that no longer exist and prints ``ValueError: Invalid process group specified``.
#
# :func:`shutdown_vllm` runs vLLM's own shutdown at a chosen point instead, before the default group goes: the
# finalizer is detached, vLLM destroys its groups and then (as it always does) the default group; a later
# ``Trainer.end()`` finds nothing left to destroy. Call it after the last collective of the run (training,
# saving, pushing), just before ``trainer.end()``.


def _engine_client(llm):
    engine = getattr(llm, "llm_engine", None)
    client = getattr(engine, "engine_core", None)  # vLLM v1: InprocClient / SyncMPClient
    return client if callable(getattr(client, "shutdown", None)) else None


def shutdown_vllm(llm) -> bool:
    """Shut the engine of ``llm`` (a ``vllm.LLM``, e.g. ``trainer.vllm_generation.llm``) down, once.

    Returns True when this call shut an engine down, False when there was nothing to do: ``llm`` is None
    (vLLM not used or not installed), the engine was shut down already, or the object has no vLLM v1 engine
    client. Idempotent. Errors of vLLM's own shutdown are not swallowed.
    """
    if llm is None or getattr(llm, "_trl_fp8_shut_down", False):
        return False
    client = _engine_client(llm)
    if client is None:
        return False
    # The engine client's shutdown detaches its exit finalizer first, so vLLM does not repeat it at exit.
    client.shutdown()
    try:
        llm._trl_fp8_shut_down = True
    except AttributeError:  # an object with __slots__: the client's detached finalizer still makes it a no-op
        pass
    return True


def shutdown_trainer_vllm(trainer) -> bool:
    """:func:`shutdown_vllm` for a trainer's colocated engine (TRL keeps it at ``trainer.vllm_generation.llm``).

    Server mode is left alone: its engine lives in the ``trl vllm-serve`` process.
    """
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "mode", None) != "colocate":
        return False
    return shutdown_vllm(getattr(generation, "llm", None))

# -- the contract -------------------------------------------------------------------------------------------------
def resolve(qualname: str):
    """The object a dotted name refers to (module path, then attributes)."""
    import importlib

    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import any prefix of {qualname!r}")


def fingerprint(qualname: str) -> str:
    """A short hash of the source of a function or method (trailing whitespace ignored)."""
    import hashlib
    import inspect

    source = inspect.getsource(resolve(qualname))
    normalised = "\n".join(line.rstrip() for line in source.splitlines())
    return hashlib.sha256(normalised.encode()).hexdigest()[:16]
