"""Which LoRA slot each token was computed with, against the adapter its request named (part of ``freshness``).

vLLM computes a token's LoRA from the slot its punica metadata names (``token_lora_indices``: one slot index per
token, -1 for none), built from the batch's mapping (the LoRA id each token's request named) and the slot layout
(``lora_index_to_id``). A stale build — metadata kept across a slot that an out-of-band ``add_lora`` re-used (vLLM
issue 47724: its memo was keyed on the mapping alone), or indices overwritten after the build — decodes a request
with another adapter, or with none, while the request still names the right one: the per-request version check,
the read-back and the slot digests all pass.

:class:`RouteGuard` wraps one LoRA manager's ``set_adapter_mapping`` (called before every forward): after it, each
token's slot is looked up in the slot layout and compared with the id its request named, on the device that holds
the indices, counted there (no host sync per forward; the requested ids are copied there only when the mapping
changes, as vLLM's own build is); :meth:`RouteGuard.take` reads the counts once per generation.
The colocated engine's stream installs it on its manager; a ``trl-fp8 vllm-serve`` worker on its own at the first
state request (before the first version is pushed).
"""

from __future__ import annotations

import torch

_SHIFT = 1 << 31  # LoRA int ids are positive int32 values: (requested, served) packed into one int64


def language_punica_wrapper(manager):
    """The punica wrapper that computes the language model's LoRA layers (one per manager before vLLM's multimodal
    LoRA; a mapping by module prefix since), or None."""
    wrapper = getattr(manager, "punica_wrapper", None)
    if wrapper is not None:
        return wrapper
    by_prefix = getattr(manager, "punica_wrapper_mapping", None) or {}
    try:
        from vllm.lora.model_manager import DEFAULT_LANGUAGE_WRAPPER_KEY

        if DEFAULT_LANGUAGE_WRAPPER_KEY in by_prefix:
            return by_prefix[DEFAULT_LANGUAGE_WRAPPER_KEY]
    except ImportError:
        pass
    mm = getattr(manager, "mm_mapping", None)
    language = getattr(mm, "language_model", None) if mm is not None else None
    return by_prefix.get(language[0]) if language else None


class RouteGuard:
    """Counts the tokens computed with a slot other than the one holding the adapter their request named."""

    ATTR = "_trl_fp8_route_guard"

    def __init__(self, manager):
        self.manager = manager
        self._table_key, self._table_ids = None, None  # the slot layout's LoRA id by slot index (+ 0: "no slot")
        self.unreadable = ""  # why the indices could not be read (the guard then says so instead of passing)
        self._wanted_key, self._wanted_ids = None, None  # the last mapping's requested ids, on the indices' device
        self._reset(None)

    @classmethod
    def install(cls, manager) -> RouteGuard:
        """The guard of ``manager`` (installed on first use: it wraps this instance's ``set_adapter_mapping``)."""
        guard = getattr(manager, cls.ATTR, None)
        if guard is None:
            guard = cls(manager)
            original = manager.set_adapter_mapping

            def set_adapter_mapping(mapping, *args, **kwargs):
                out = original(mapping, *args, **kwargs)
                guard.observe(mapping)
                return out

            manager.set_adapter_mapping = set_adapter_mapping
            setattr(manager, cls.ATTR, guard)
        return guard

    def _reset(self, device) -> None:
        self.tokens = 0
        self.forwards = 0
        self._bad = None if device is None else torch.zeros((), dtype=torch.int64, device=device)
        self._example = None if device is None else torch.full((), -1, dtype=torch.int64, device=device)

    def _table(self, layout: tuple, device) -> torch.Tensor:
        """The LoRA id each slot holds, on ``device``, built again only when the layout changed; index -1 (no slot)
        reads the last entry: id 0, what a request without an adapter names."""
        if self._table_key != (layout, str(device)):
            self._table_key = (layout, str(device))
            self._table_ids = torch.tensor([0 if i is None else int(i) for i in layout] + [0], dtype=torch.int64,
                                           device=device)
        return self._table_ids

    def _wanted(self, requested: tuple, device) -> torch.Tensor:
        """The requested ids on ``device``, copied only when the mapping changed (a decoding batch keeps its mapping
        from one forward to the next, and a copy to a GPU waits for the work queued before it)."""
        if self._wanted_key != (requested, str(device)):
            self._wanted_key = (requested, str(device))
            self._wanted_ids = torch.tensor(requested, dtype=torch.int64, device=device)
        return self._wanted_ids

    @torch.no_grad()
    def observe(self, mapping) -> None:
        """After the metadata for one forward was set: compare every token's slot with its request's LoRA id."""
        kind = getattr(mapping, "type", None)
        if kind is not None and getattr(kind, "name", "LANGUAGE") != "LANGUAGE":
            return  # a vision tower's or connector's mapping: not the language model's LoRA
        requested = tuple(mapping.index_mapping)
        if not requested:
            return
        wrapper = language_punica_wrapper(self.manager)
        slots = getattr(wrapper, "token_lora_indices", None) if wrapper is not None else None
        if not isinstance(slots, torch.Tensor) or slots.numel() < len(requested):
            self.unreadable = (f"the engine's per-token LoRA slots could not be read ({type(wrapper).__name__}, "
                               f"{None if slots is None else tuple(slots.shape)} for {len(requested)} tokens)")
            return
        slots = slots[: len(requested)].to(torch.int64)
        if self._bad is None or self._bad.device != slots.device:
            self._reset(slots.device)
        served = self._table(tuple(self.manager.lora_index_to_id), slots.device)[slots]
        wanted = self._wanted(requested, slots.device)
        bad = served != wanted
        self._bad += bad.sum()
        torch.maximum(self._example, torch.where(bad, wanted * _SHIFT + served, -1).max(), out=self._example)
        self.tokens += len(requested)
        self.forwards += 1

    def take(self) -> dict:
        """What was observed since the last call (then forgotten): ``tokens`` compared, ``misrouted`` of them, and
        ``example`` — one misrouted token's ``[requested id, served id]`` (0: no adapter) — or ``unreadable``."""
        out = {"tokens": self.tokens, "forwards": self.forwards, "misrouted": 0, "example": None}
        if self._bad is not None:
            out["misrouted"] = int(self._bad.item())
            code = int(self._example.item())
            if code >= 0:
                out["example"] = [code // _SHIFT, code % _SHIFT]
        if self.unreadable:
            out["unreadable"] = self.unreadable
        self._reset(None if self._bad is None else self._bad.device)
        self.unreadable = ""
        return out


def merge(takes) -> dict:
    """Several workers' :meth:`RouteGuard.take` (a tensor-parallel server: one per worker) as one."""
    out = {"tokens": 0, "forwards": 0, "misrouted": 0, "example": None}
    for one in takes:  # every worker computes every token (with its shard of the layers): the largest count
        if not one:
            continue
        for key in ("tokens", "forwards", "misrouted"):
            out[key] = max(out[key], int(one.get(key) or 0))
        if out["example"] is None and one.get("example"):
            out["example"] = list(one["example"])
        if one.get("unreadable"):
            out["unreadable"] = one["unreadable"]
    return out
