"""What the trainer's sampler serves, behind one interface, one class per kind of the sampling decision
(:mod:`trl_fp8.sampling`): an in-process transformers model (a twin), fast QLoRA's rollout cache (rebuilt per
generation, nothing synced into it), a vLLM engine in the same process (TRL's colocate mode) or a vLLM server, each
sent dense tensors, and a colocated engine's or a ``trl-fp8 vllm-serve`` server's LoRA versions (adapters, base
loaded once). Which one a run has, and how it is installed, is the decided kind's handler's (:mod:`trl_fp8.kinds`).

A sampler answers in *learner names* (``model.layers.0.self_attn.q_proj.weight``), whatever its own layout (vLLM
fuses q/k/v and gate/up into one parameter). What it can do is declared, not assumed: ``readable`` (its tensors
can be read back), ``has_prefix_cache`` (it keeps a prefix/KV cache across calls) and ``cache_observable`` (that
cache's state can be read). Fair Cast exports into a sampler, the weight-sync checks read back from it. The
numerics of its tensors are data (:class:`trl_fp8.numerics.TensorSpec`): the capability that quantizes a layer
passes a ``describe`` function, so this module knows no quantization format. TRL's and vLLM's private functions are
reached through :mod:`trl_fp8._trl` only; by design the vLLM samplers read their engine's layers and LoRA buffers
themselves (listed in :mod:`trl_fp8._trl`'s docstring).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch

from . import _trl, numerics
from .engine_weights import EngineWeights, effective_columns  # noqa: F401 (re-exported)

VERSION_ATTR = "_trl_fp8_weight_version"
ALIAS_PROBE_COLUMNS = 8  # input dimensions probed through a tied output layer per check


class SyncLog:
    """What one sync streamed: counts, shapes, dtypes and (references to) the tensors, per learner name."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def tap(self, named: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in named:
            self.counts[name] = self.counts.get(name, 0) + 1
            self.tensors[name] = tensor
            yield name, tensor


def probe_columns(numel: int, count: int, step: int) -> torch.Tensor:
    """A deterministic, step-dependent choice of input dimensions to probe."""
    gen = torch.Generator().manual_seed(0x7F8 + int(step))
    return torch.randperm(numel, generator=gen)[: min(count, numel)].sort().values


class Sampler:
    """Base class: the in-process view of a sampler. Subclasses fill in what their engine allows."""

    label = "sampler"
    readable = True  # read()/load() reach the tensors it computes with
    synced = True  # weights are synced into it (False: it computes from the learner's own, e.g. a rollout cache)
    has_prefix_cache = False  # keeps a prefix/KV cache across generate calls
    cache_observable = False  # ... whose state cached_blocks()/reset_cache() can report
    serves_digests = False  # served_digests() reports what it computes with now (re-verified after each generation)

    def manifest(self) -> dict[str, tuple[tuple, torch.dtype]]:
        """Learner name -> (shape, dtype) of every tensor the sampler serves."""
        raise NotImplementedError

    def targets(self, names: Iterable[str]) -> dict[str, list[str]]:
        """The sampler's own write targets (a parameter, or one shard of a fused one) -> learner names."""
        return {n: [n] for n in names}

    def read(self, name: str) -> torch.Tensor:
        """The tensor the sampler holds for a learner name (a view; clone before the next load)."""
        raise NotImplementedError

    def read_effective(self, name: str) -> torch.Tensor:
        """What the sampler computes with: ``read`` dequantized through its quantizer where it has one."""
        return self.read(name)

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def version(self):
        return None

    def set_version(self, step: int) -> None:
        pass

    def rollout_versions(self):
        """The adapter versions the rollouts finished since the last call were generated with (version -> count;
        None: a request without an adapter), then forgotten; None where the sampler does not report them."""
        return None

    def sequence_logprobs(self, prompts: list[list[int]], completions: list[list[int]],
                          temperature: float = 1.0) -> list[list[float]]:
        """log μ(token) of each completion token given its prompt, as the sampler computes it."""
        raise NotImplementedError(f"a {self.label} sampler cannot score given token sequences")

    def reset_cache(self) -> bool | None:
        return None

    def cached_blocks(self) -> int | None:
        return None

    def recipe(self) -> dict[str, numerics.TensorSpec]:
        """Learner name -> the spec of what the sampler computes with (the cast its load applies is set by the
        caller, who knows what was sent)."""
        return {name: numerics.dense(dtype) for name, (_, dtype) in self.manifest().items()}

    def alias_reads(self, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Tied aliases: alias -> (columns it effectively computes with, the same columns of its target)."""
        return {}

    def cold(self, named: dict[str, torch.Tensor]):
        """A fresh sampler built directly from ``named`` (bypassing the load path), or None if impossible."""
        return None

    def begin_round(self) -> None:
        """A round of checks begins: nothing read before it may be reused (a sampler that reads remotely forgets
        what it read)."""

    def watch_routes(self) -> None:
        """Start observing which LoRA slot each token is computed with (before the first rollout), where the sampler
        serves LoRA versions; a no-op elsewhere."""

    def served_routes(self) -> dict | None:
        """Tokens computed since the last call against the LoRA slots their requests named
        (:meth:`trl_fp8._trl.vllm_routing.RouteGuard.take`), then forgotten; None where not observed."""
        return None

    def route_label(self, lora_id: int):
        """The adapter version an engine LoRA id serves (None: none the learner pushed)."""
        return None

    def served_digests(self, names: Iterable[str]) -> dict[str, str] | None:
        """The digests (:func:`trl_fp8.digest.tensor_digest`) of what the sampler computes with now, by learner name
        — computed where it lives; None where it cannot say. The checks compare them with the last sync's after each
        generation: a copy changed after the sync (a reload in place, an overwritten slot) is caught at the step
        whose rollouts it touched."""
        return None

    def identity(self, names: Iterable[str]) -> dict | None:
        """The served identity of the sampler's base (:func:`trl_fp8.sync_checks.identity.engine_identity`) under
        the learner's base names, or None where the base is not loaded separately (it is streamed, or shared)."""
        return None


class RolloutCacheSampler(Sampler):
    """The learner itself, decoding through a cache of its own weights in another dtype (fast QLoRA's rollout
    cache). Nothing is synced into it, so only the logprob check applies (``synced = False``)."""

    label = "rollout cache"
    readable = False
    synced = False

    def manifest(self):
        return {}


class TransformersSampler(Sampler):
    """A transformers model that generates in the trainer's process (e.g. Fair Cast's low-precision twin)."""

    label = "transformers"  # generate() keeps no KV cache across calls: no prefix cache

    def __init__(self, model: torch.nn.Module,
                 describe: Callable[[torch.nn.Module], dict[str, numerics.TensorSpec]] | None = None):
        """``describe(model)``: specs of the tensors a capability quantizes (read from the modules themselves, so a
        layer that computes differently reports it); every other tensor is dense in its own dtype."""
        self.model = model
        self.describe = describe
        self._params = dict(model.named_parameters())

    def manifest(self):
        return {n: (tuple(p.shape), p.dtype) for n, p in self._params.items()}

    def read(self, name):
        return self._params[name].data

    def read_effective(self, name):
        tensor = self._params[name].data
        if self.describe is None:
            return tensor
        spec = self.recipe().get(name)
        if spec is None or (spec.format == "dense" and numerics.torch_dtype(spec.dtype) == tensor.dtype):
            return tensor  # what quantize returns for it, without the call (the checks ask per tensor, per sync)
        return numerics.quantize(tensor, spec)

    def recipe(self):
        # Read from the modules once per weight version (a sync), not once per tensor: quant_parity asks per tensor.
        version = self.version()
        cached = getattr(self, "_recipe", None)
        if cached is not None and version is not None and cached[0] == version:
            return cached[1]
        out = super().recipe()
        if self.describe is not None:
            out.update({n: s for n, s in self.describe(self.model).items() if n in out})
        self._recipe = (version, out)
        return out

    @torch.no_grad()
    def load(self, named):
        for name, tensor in named:
            if name not in self._params:
                raise KeyError(f"the in-process sampler has no parameter '{name}'")
            self._params[name].data.copy_(tensor)

    @torch.no_grad()
    def sequence_logprobs(self, prompts, completions, temperature=1.0):
        out = []
        device = next(self.model.parameters()).device
        for prompt, completion in zip(prompts, completions, strict=True):
            if not completion:
                out.append([])
                continue
            ids = torch.tensor([list(prompt) + list(completion)], device=device)
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / temperature
            logps = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
            out.append(logps.tolist())
        return out

    def version(self):
        return getattr(self.model, VERSION_ATTR, None)

    def set_version(self, step):
        setattr(self.model, VERSION_ATTR, int(step))

    # alias_reads: the base's (none). A transformers output layer computes with its `weight` parameter itself: when it
    # *is* the embedding's parameter (tied), no stale copy can exist, and there is nothing to probe.

    def cold(self, named):
        twin = copy.deepcopy(self.model)
        vars(twin).pop("forward", None)  # a patched forward's closure would still point at the original model
        params = dict(twin.named_parameters())
        for name, tensor in named.items():
            params[name].data = tensor.detach().clone().to(params[name].dtype)
        return TransformersSampler(twin, self.describe)


class VLLMColocateSampler(EngineWeights, Sampler):
    """A vLLM engine in the trainer's process (TRL's colocate mode), read through its model runner (its weights by the
    learner's names: :class:`trl_fp8.engine_weights.EngineWeights`)."""

    label = "vllm-colocate"
    has_prefix_cache = cache_observable = True

    def __init__(self, llm, learner_names: Iterable[str]):
        self.llm = llm
        EngineWeights.__init__(self, _trl.vllm_model(llm), learner_names)

    def manifest(self):
        out = {}
        for name, where in self._where.items():
            if where is None:
                continue
            pname, shard, offset, rows = where
            full = self._full_shape(pname)
            out[name] = (full if shard is None else (rows, *full[1:]), self._params[pname].dtype)
        return out

    def targets(self, names):
        targets: dict[str, list[str]] = {}
        for pname in self._params:  # every engine parameter, and every shard of a fused one, must be written
            module = self.model.get_submodule(pname.rpartition(".")[0]) if "." in pname else None
            shards = len(getattr(module, "output_sizes", []) or []) if module is not None else 0
            keys = [f"{pname}[{i}]" for i in range(shards)] if shards > 1 else [pname]
            for key in keys:
                targets[key] = []
        for name, where in self._where.items():
            if where is None:
                continue
            pname, shard, _, _ = where
            key = pname if shard is None else f"{pname}[{shard}]"
            targets.setdefault(key, []).append(name)
        return targets

    @torch.no_grad()
    def load(self, named):
        for name, tensor in named:  # TRL 1.16's colocate path, one tensor at a time
            self.model.load_weights([(name, tensor)])

    def sequence_logprobs(self, prompts, completions, temperature=1.0):
        """Through the engine's prompt logprobs (one forward per sequence; no sampling)."""
        return _trl.engine_sequence_logprobs(self.llm, prompts, completions, temperature)

    def version(self):
        return _trl.vllm_weight_version(self.llm)

    def set_version(self, step):
        _trl.set_vllm_weight_version(self.llm, step)

    def reset_cache(self):
        return bool(self.llm.reset_prefix_cache())

    def cached_blocks(self):
        return _trl.vllm_cached_blocks(self.llm)

    def recipe(self):
        out = {}
        for name, (_, dtype) in self.manifest().items():
            spec = numerics.dense(dtype)
            module = self.model.get_submodule(self._where[name][0].rpartition(".")[0])
            method = getattr(module, "quant_method", None)
            if method is not None and not type(method).__name__.startswith("Unquantized"):
                spec = spec.with_(format="engine", kernel=type(method).__name__)  # vLLM's own quantization
            out[name] = spec
        return out

    def alias_reads(self, step):
        lm_head = getattr(self.model, "lm_head", None)
        embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not embed.weight:
            return {}
        target = next((n for n, p in self._params.items() if p is embed.weight), None)
        if target is None:
            return {}
        weight = embed.weight
        cols = probe_columns(weight.shape[1], ALIAS_PROBE_COLUMNS, step)
        effective = effective_columns(lambda x: lm_head.quant_method.apply(lm_head, x), weight.shape[1], cols,
                                      weight.dtype, weight.device)
        return {"lm_head.weight": (effective[: weight.shape[0]], weight.data[:, cols.to(weight.device)])}


class VLLMServerSampler(Sampler):
    """A ``trl vllm-serve`` server: tensors cannot be read back, so only what the client sees is checked. It keeps a
    prefix cache, but the reset endpoint reports nothing and the cache's state cannot be read."""

    label = "vllm-server"
    readable = False
    has_prefix_cache = True

    def __init__(self, client, shapes: dict[str, tuple]):
        self.client = client
        self._shapes = shapes  # the server loads by name; its dtype comes from get_server_info

    def manifest(self):
        info = self.client.get_server_info()
        dtype = numerics.torch_dtype(info["model_config"]["dtype"])
        return {n: (tuple(shape), dtype) for n, shape in self._shapes.items()}

    def reset_cache(self):
        self.client.reset_prefix_cache()
        return None  # the endpoint does not report success


def lora_sampler(lora, learner_names=None) -> "VLLMLoraSampler":
    """A :class:`trl_fp8._trl.VLLMLoraStream`'s engine as the weight-sync checks read it (``learner_names``: the
    stream's names; default: the last push's, else the stream's now)."""
    if learner_names is None:
        learner_names = lora.current.names if lora.current is not None else [n for n, _ in lora.stream()]
    return VLLMLoraSampler(lora, learner_names)


class AdapterVersions:
    """What a sampler served LoRA versions does through its stream (``self.lora``: a colocated engine's or a server's):
    ``load`` pushes a new version under the current label (nothing to load: nothing pushed, e.g. the checks' start-up
    oracle before the first sync, when the engine serves the bare base), the version label, and the versions the
    finished rollouts report."""

    def load(self, named):
        named = list(named)
        if named:
            self.lora.push(named, self.lora.version())

    def version(self):
        return self.lora.version()

    def set_version(self, step):
        self.lora.set_version(int(step))

    def rollout_versions(self):
        return self.lora.rollout_versions()

    def watch_routes(self):
        self.lora.watch_routes()

    def served_routes(self):
        return self.lora.routes()

    def route_label(self, lora_id):
        return self.lora.label_of(lora_id)


class VLLMLoraSampler(AdapterVersions, Sampler):
    """A colocated engine serving LoRA versions, read in the learner's (PEFT's) names: each factor is the slice of
    its LoRA layer's stacked buffer (``lora_a_stacked`` / ``lora_b_stacked``, per packed sub-module) at the slot of
    the current version — what the kernels compute with. ``load`` pushes a new version."""

    label = "vllm-colocate-lora"
    has_prefix_cache = cache_observable = True
    serves_digests = True

    def __init__(self, lora, learner_names):
        self.lora = lora
        self.llm = lora.llm
        manager = lora.manager
        # tensor-parallel engines hold a shard of each factor: what they compute with is not the tensor sent
        tp = lora.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        self.readable = tp == 1 and not manager.lora_config.fully_sharded_loras
        from ._trl.vllm_lora import _locate, peft_to_vllm_name

        self._where = {n: _locate(manager, peft_to_vllm_name(n, lora.spec.adapter)) for n in learner_names}

    def _registered(self, module: str, index: int, is_a: bool):
        current = self.lora.current
        model = self.lora.manager.get_adapter(current.lora_id) if current is not None else None
        weights = model.get_lora(module) if model is not None else None
        if weights is None:
            return None
        tensor = weights.lora_a if is_a else weights.lora_b
        return tensor[index] if isinstance(tensor, list) else tensor

    def manifest(self):
        out = {}
        for name, where in self._where.items():
            if where is None:
                continue
            tensor = self._registered(*where)
            if tensor is not None:
                out[name] = (tuple(tensor.shape), self.lora.dtype)
        return out

    def targets(self, names):
        targets: dict[str, list[str]] = {}
        for name, where in self._where.items():
            if where is not None:
                module, index, is_a = where
                targets.setdefault(f"{module}[{index}].{'lora_A' if is_a else 'lora_B'}", []).append(name)
        return targets

    def read(self, name):
        from ._trl.vllm_lora import slot_factor

        where = self._where.get(name)
        if where is None:
            raise KeyError(f"the vLLM engine has no LoRA layer for '{name}'")
        current = self.lora.current
        if current is None:
            raise KeyError(f"the engine serves no LoRA version, so nothing for '{name}'")
        try:
            tensor = slot_factor(self.lora.manager, current.lora_id, where)
        except LookupError:
            raise RuntimeError("the engine holds no current LoRA version in its slots") from None
        if tensor is None:
            raise KeyError(f"the current LoRA version holds nothing for '{name}'")
        return tensor

    def served_digests(self, names):
        from .digest import tensor_digest

        out = {}
        for name in names:
            try:
                out[name] = tensor_digest(self.read(name))
            except KeyError:
                continue
        return out

    def identity(self, names):
        from .engine_weights import engine_identity

        config = self.llm.llm_engine.model_config
        return engine_identity(_trl.vllm_model(self.llm), list(names), config.dtype, config.quantization,
                               self.llm.get_tokenizer())

    def sequence_logprobs(self, prompts, completions, temperature=1.0):
        return self.lora.sequence_logprobs(prompts, completions, temperature)

    def reset_cache(self):
        return bool(self.llm.reset_prefix_cache())

    def cached_blocks(self):
        return _trl.vllm_cached_blocks(self.llm)

    def recipe(self):
        return {name: numerics.dense(dtype) for name, (_, dtype) in self.manifest().items()}


class VLLMServerLoraSampler(AdapterVersions, Sampler):
    """A ``trl-fp8 vllm-serve`` server's current adapter version, read back through its workers (the factors they hold,
    by PEFT name); ``load`` pushes a new version. Its prefix cache cannot be read (a new LoRA id every version keeps
    old blocks from being reused)."""

    label = "vllm-server-lora"
    has_prefix_cache = True
    serves_digests = True
    cache_observable = False

    def __init__(self, lora):
        self.lora = lora
        self.client = lora.client

    def manifest(self):
        return {n: (tuple(t.shape), t.dtype) for n, t in self.lora.read_back().items()}

    def targets(self, names):
        return {n: [n] for n in self.manifest()}

    def read(self, name):
        held = self.lora.read_back()
        if name not in held:
            raise KeyError(f"the vLLM server's current LoRA version holds nothing for '{name}'")
        return held[name]

    def reset_cache(self):
        self.client.reset_prefix_cache()
        return None

    def recipe(self):
        return {name: numerics.dense(dtype) for name, (_, dtype) in self.manifest().items()}

    def begin_round(self):
        self.lora.forget()

    def served_digests(self, names):
        return self.lora.served_digests(names)

    def identity(self, names):
        return self.lora.identity(names)
