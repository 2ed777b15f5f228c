"""What trl_fp8 relies on in TRL, written down: the tested TRL range, the methods it overrides and calls, the trainer
attributes it reads, fingerprints of the TRL code it mirrors, the module globals it patches (pinned by
``tests/test_trl_contract.py``)."""

from __future__ import annotations


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
    # a stop point before each micro-batch; TRL's own counts _step after it (the step boundary trl_fp8 records)
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
}
# Private attributes and methods of a constructed trl.GRPOTrainer that trl_fp8 reads or calls.
TRAINER_ATTRIBUTES = (
    "_metrics", "_tokenizer", "model_wrapped", "use_vllm", "vllm_mode",
    "use_transformers_continuous_batching", "temperature", "num_generations", "max_completion_length",
    "eos_token_ids", "pad_to_multiple_of", "generation_config", "generation_kwargs", "tools", "rollout_func",
    "environment_factories", "ref_model", "is_deepspeed_enabled", "is_fsdp_enabled", "compute_loss_context_manager",
    "_get_output_dir", "reward_func_names", "loss_type",
    # checkpoints (trl_fp8.checkpoints, through write_checkpoint_files / generation_buffer below)
    "_save_optimizer_and_scheduler", "_save_scaler", "_save_rng_state", "_push_from_checkpoint", "_load_from_checkpoint",
    "hp_search_backend",
    "use_adaptive_entropy", "entropy_coef", "_last_world_entropy", "num_iterations", "_step", "_buffered_inputs",
    "_tokenize_prompts",  # DUET keys its per-prompt tables by the prompt as TRL tokenizes it
)
# The modules outside trl_fp8._trl that read TRL-private trainer names themselves (module path below trl_fp8/ -> the
# names, each in TRAINER_ATTRIBUTES): tests/test_trl_contract.py finds every `trainer._<name>` outside _trl that TRL's
# or transformers' trainer sets and holds it to this list.
PRIVATE_READERS = {
    "checkpoints/boundary.py": ("_buffered_inputs", "_step"),
    "checkpoints/save.py": ("_buffered_inputs", "_step"),
    "duet/component.py": ("_tokenize_prompts", "_tokenizer"),
}
# ... and those set only with use_vllm=True (on the trainer, then on its VLLMGeneration).
VLLM_ATTRIBUTES = {
    "GRPOTrainer": ("vllm_generation",),
    "VLLMGeneration": ("mode", "llm", "vllm_client", "accelerator",
                       # DUET's requests are built with TRL's sampling settings (vllm_sampling_kwargs)
                       "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_completion_length",
                       "logprobs", "generation_kwargs", "structured_outputs_regex",
                       # adapter serving (vllm_lora) refuses sleep mode and replaces sync_weights on the instance
                       "enable_sleep_mode"),
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
    "trl.trainer.grpo_trainer.GRPOTrainer._generate_and_score_completions":
        "num_items_in_batch (the dapo normaliser) is the gathered sum of completion_mask (x tool_mask), counted before "
        "the batch is returned: recount_items recounts it after DUET masks placeholder and aborted rows",
    "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss":
        "its first _get_per_token_logps_and_entropies call is the policy's forward on the batch; the dapo, cispo and "
        "vespo losses sum the masked per-token loss over the rows and divide by num_items_in_batch (a row whose mask "
        "is all zero adds nothing: drop_masked_rows leaves such rows out of the batch)",
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
        "quantization='bitsandbytes' for a 4-bit policy and no dtype (plain_cpu_linears and engine_context rewrite them "
        "as the sampling decision says)",
    "transformers.trainer.Trainer._maybe_log_save_evaluate":
        "log, then evaluate, then _save_checkpoint followed by on_save: the time budget measures a save from the last "
        "event before it (step end, on_log or on_evaluate) to on_save",
}
# Module globals of other packages that trl_fp8 patches (only inside plain_cpu_linears and engine_context, while TRL
# builds its engine; restored after).
PATCHED_GLOBALS = (
    "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
    "trl.generation.vllm_generation.LLM",
    "trl.generation.vllm_generation.VLLMClient",
)


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
