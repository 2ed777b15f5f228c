"""Every TRL-, transformers- and vLLM-private name trl_fp8 touches, in one place.

Split by what it adapts — ``trainer`` (TRL's trainer internals), ``checkpoint`` (TRL's and transformers' checkpoint
internals), ``vllm_engine`` (TRL's vLLM generation and the colocated engine), ``vllm_lora`` (LoRA versions pushed
to a colocated engine, imported on first use), ``vllm_server_lora`` (adapter versions pushed to a ``trl-fp8
vllm-serve`` server, imported on first use), ``vllm_routing`` (the LoRA slot each token reads, against its
request's adapter), ``vllm_worker`` (the worker extension such a server starts with),
``cli`` (TRL's command line) and ``contract`` (what is pinned) — and re-exported here: callers use
``trl_fp8._trl.<name>``.

Outside this package, trl_fp8 reaches into a private method, an undocumented attribute or a module global of TRL or
vLLM only at these sites, each listed in :data:`PRIVATE_READERS` (the contract test finds every ``trainer._<name>``
outside ``_trl`` that TRL's or transformers' trainer sets and holds it to that list) and each name pinned in
:data:`TRAINER_ATTRIBUTES`:

- ``checkpoints/boundary.py`` records TRL's micro-batch position (``_step``) and the buffered generation
  (``_buffered_inputs``) at each step boundary, and ``checkpoints/save.py`` puts them back around a save of a
  step stopped mid-way (two sites) — TRL's ``_prepare_inputs`` reads them (fingerprinted in :data:`MIRRORED`);
- ``duet/component.py`` tokenizes a dataset row as TRL does (``_tokenize_prompts``) to key its per-prompt tables, and
  hands TRL's tokenizer (``_tokenizer``) to its stopping rule and to its vLLM rollouts (two sites);
- by design, :class:`trl_fp8.samplers.VLLMColocateSampler` is the adapter of a vLLM engine's *layers*
  (``packed_modules_mapping``, ``output_sizes``, ``quant_method``, ``input_size_per_partition``) and reads them
  itself, and :class:`trl_fp8.samplers.VLLMLoraSampler` reads the LoRA layers' stacked buffers (``lora_a_stacked`` /
  ``lora_b_stacked``) and the adapter manager's slots; the real-engine tests (``tests/sync_checks/test_vllm_engine.py``,
  ``tests/test_vllm_lora.py``) exercise every one of them.

``tests/test_trl_contract.py`` pins what this module relies on — the signatures of the TRL methods trl_fp8 overrides
or calls, the trainer attributes it reads, the sites above, and a fingerprint (hash of the source) of each TRL code
block whose *internals* it depends on — so a TRL upgrade fails with the list of what moved instead of a silent
change. Tested with the TRL range in :data:`TESTED_TRL`.
"""

from __future__ import annotations

from .checkpoint import (  # noqa: F401
    write_checkpoint_files,
    run_dir,
    load_model_from_checkpoint,
    push_checkpoint,
    generation_buffer,
    advance_train_sampler,
    restore_generation_buffer,
)
from .cli import (  # noqa: F401
    resolve_accelerate_config,
    subtract_subsequence,
)
from .contract import (  # noqa: F401
    TESTED_TRL,
    OVERRIDDEN,
    TRAINER_ATTRIBUTES,
    VLLM_ATTRIBUTES,
    MIRRORED,
    PATCHED_GLOBALS,
    PRIVATE_READERS,
    resolve,
    fingerprint,
)
from .trainer import (  # noqa: F401
    record_metric,
    recount_items,
    drop_masked_rows,
    TOKEN_SUM_LOSSES,
    drop_reward_metrics_of_last_batch,
    trl_generate,
    policy_logps,
    num_beams,
    generating_with,
    repatch_fused_head,
    patch_fused_head,
    peft_config_argument,
    quantization_config_argument,
)
from .vllm_engine import (  # noqa: F401
    engine_sequence_logprobs,
    trl_vllm_stream,
    vllm_name,
    set_vllm_stream,
    DenseVLLMStream,
    wrap_vllm_sync,
    vllm_engine_dtype,
    replacing_vllm_generate,
    vllm_sampling_kwargs,
    vllm_delta_params,
    vllm_add_request,
    vllm_step,
    vllm_abort,
    vllm_model,
    vllm_weight_version,
    set_vllm_weight_version,
    vllm_cached_blocks,
    plain_cpu_linears,
    vllm_platform_is_cpu,
    vllm_engine_quantization,
    engine_context,
    shutdown_vllm,
    shutdown_trainer_vllm,
)

# vllm_lora (the vLLM LoRA glue) is imported on first use: it needs vLLM internals only when used.
_LAZY = {"VLLMServerLoraStream": ".vllm_server_lora"}
_LAZY.update({name: ".vllm_lora" for name in (
    "LoraEngineSpec", "VLLMLoraStream", "lora_manager", "engine_rank", "fourbit_base_stream",
)})


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
