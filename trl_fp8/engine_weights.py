"""A vLLM engine's weights read by the learner's names — what its kernels compute with: a parameter as it is, a shard
of a packed one (``qkv_proj``, ``gate_up_proj``) sliced out, a LoRA wrapper's ``base_layer`` looked through, a weight
vLLM-CPU packed away or a quantized one (bitsandbytes, AWQ, FP8) read through the layer's own forward on one-hot
inputs. Used by the colocated sampler (:class:`trl_fp8.samplers.VLLMColocateSampler`) and, inside a server's worker,
by the served-identity check (:func:`engine_identity`). Imports torch only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .digest import tensor_digest, tokenizer_digest


def effective_columns(apply, weight_cols: int, columns: torch.Tensor, dtype, device) -> torch.Tensor:
    """Columns of the weight an output layer *computes with*, read through its forward on one-hot inputs.

    For ``y = x Wᵀ`` a one-hot ``x`` returns a column of ``W`` exactly (one product by 1, sums of zeros), so this
    reads packed or cached copies that no parameter exposes (vLLM-CPU repacks linear weights)."""
    x = torch.zeros(len(columns), weight_cols, dtype=dtype, device=device)
    x[torch.arange(len(columns)), columns.to(device)] = 1
    with torch.no_grad():
        return apply(x).T


class EngineWeights:
    """A vLLM model's weights by the learner's names (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, learner_names: Iterable[str]):
        self.model = model
        self._params = dict(self.model.named_parameters())
        # an engine started with LoRA wraps each target layer: its weight is the wrapper's ``base_layer``'s
        self._wrapped = {n.replace(".base_layer.", "."): n for n in self._params if ".base_layer." in n}
        self._where = {n: self._locate(n) for n in learner_names}

    def _param_name(self, name: str) -> str | None:
        if name in self._params:
            return name
        return self._wrapped.get(name)

    # learner name -> (vLLM parameter name, shard index or None, row offset, rows)
    def _locate(self, name: str):
        own = self._param_name(name)
        if own is not None:
            return own, None, 0, self._params[own].shape[0] if self._params[own].ndim else 0
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        for fused, parts in (getattr(type(self.model), "packed_modules_mapping", None) or {}).items():
            if proj in parts:
                fused_name = self._param_name(f"{parent}.{fused}.{leaf}")
                if fused_name is None:
                    continue
                module = self.model.get_submodule(fused_name.rpartition(".")[0])
                sizes = list(module.output_sizes) if hasattr(module, "output_sizes") else None
                if sizes is None or len(sizes) != len(parts):  # e.g. qkv with output_sizes on the module only
                    continue
                i = parts.index(proj)
                return fused_name, i, sum(sizes[:i]), sizes[i]
        return None

    def _packed(self, pname: str):
        """The linear layer whose weight vLLM-CPU packed away (the parameter left empty), else None."""
        p = self._params[pname]
        if p.numel() or not pname.endswith(".weight"):
            return None
        module = self.model.get_submodule(pname.rpartition(".")[0])
        return module if hasattr(module, "input_size_per_partition") and hasattr(module, "quant_method") else None

    def _full_shape(self, pname: str) -> tuple:
        module = self._packed(pname)
        if module is None:
            return tuple(self._params[pname].shape)
        return (module.output_size_per_partition, module.input_size_per_partition)

    def read(self, name):
        where = self._where.get(name)
        if where is None:
            raise KeyError(f"the vLLM engine serves nothing under '{name}'")
        pname, shard, offset, rows = where
        module = self._packed(pname)
        if module is not None:  # read the packed weight back through the layer's own matmul (one-hot inputs)
            k, dtype = module.input_size_per_partition, self._params[pname].dtype
            p = effective_columns(lambda x: module.quant_method.apply(module, x), k, torch.arange(k), dtype,
                                  self._params[pname].device)
        else:
            p = self._params[pname].data
        return p if shard is None else p[offset: offset + rows]

    COMPUTED_COLUMNS = 1024  # one-hot columns per forward when a quantized weight is read through its kernel

    def quantized(self, name: str):
        """The linear layer behind ``name`` when it computes through a quantization method (bitsandbytes, AWQ, FP8:
        its parameters hold packed codes, not the weight), else None."""
        where = self._where.get(name)
        if where is None or not where[0].endswith(".weight"):
            return None
        module = self.model.get_submodule(where[0].rpartition(".")[0])
        method = getattr(module, "quant_method", None)
        if method is None or type(method).__name__.startswith("Unquantized"):
            return None
        return module

    @torch.no_grad()
    def read_computed(self, name: str, force: bool = False) -> torch.Tensor:
        """The weight the engine's kernel computes with under ``name``: :meth:`read`, except for a quantized layer
        (or with ``force``), read through the layer's own forward on one-hot inputs, ``COMPUTED_COLUMNS`` columns at
        a time (a dequantized weight, exact: one product by 1 per output) — what the served-identity check digests."""
        module = self.quantized(name)
        if module is None and not force:
            return self.read(name)
        if module is None:
            module = self.model.get_submodule(self._where[name][0].rpartition(".")[0])
        base = getattr(module, "base_layer", module)
        pname, shard, offset, rows = self._where[name]
        k, dtype = base.input_size_per_partition, self.llm_dtype(base)
        device = next(base.parameters()).device
        apply = (lambda x: base.quant_method.apply(base, x))  # noqa: E731
        parts = [effective_columns(apply, k, torch.arange(i, min(k, i + self.COMPUTED_COLUMNS)), dtype, device)
                 for i in range(0, k, self.COMPUTED_COLUMNS)]
        weight = torch.cat(parts, dim=1)
        return weight if shard is None else weight[offset: offset + rows]

    def llm_dtype(self, module) -> torch.dtype:
        """The dtype a layer computes in: its parameters' floating dtype, else the engine's."""
        for p in module.parameters():
            if p.is_floating_point():
                return p.dtype
        llm = getattr(self, "llm", None)
        if llm is not None:
            return llm.llm_engine.model_config.dtype
        return torch.get_default_dtype()



def describe(tensors: dict, dtype, quantization: str | None, tokenizer) -> dict:
    """One side's served identity: trl_fp8's version, the dtype, the base's quantization, the tokenizer's digest (None:
    none to describe) and the base tensors' digests (by the learner's names)."""
    from ._version import __version__

    return {"version": str(__version__), "dtype": str(dtype).removeprefix("torch."), "quantization": quantization,
            "tokenizer": None if tokenizer is None else tokenizer_digest(getattr(tokenizer, "tokenizer", tokenizer)),
            "tensors": tensors}


def engine_identity(model, names, dtype, quantization, tokenizer) -> dict:
    """What a vLLM engine computes with, in the learner's names (``names``), for the served-identity check
    (:mod:`trl_fp8.sync_checks.identity`): run inside the engine's process (the colocated engine's, or a server
    worker's through its extension). A quantized layer is read through its own kernel (the dequantized weight it
    computes with, not its packed codes). A name the engine holds nothing under maps to None."""
    reader = EngineWeights(model, names)
    tensors = {}
    for name in names:
        try:
            tensor = reader.read_computed(name)
        except KeyError:
            tensors[name] = None
            continue
        tensors[name] = tensor_digest(tensor)
    return describe(tensors, dtype, quantization, tokenizer)
