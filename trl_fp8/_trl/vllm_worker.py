"""A vLLM worker extension for ``trl-fp8 vllm-serve`` (``--worker-extension-cls
trl_fp8._trl.vllm_worker.AdapterWorker``): what the trainer asks a server's workers through ``/collective_rpc``.

``trl_fp8_lora_state(request)`` (``request``: a JSON string, as ``/collective_rpc`` passes only strings): the newest
LoRA id the worker holds and every id resident in its cache; with ``keep_latest`` it first drops every other version
(vLLM's API server only forgets an unloaded name; its workers would keep it in their cache) and moves the newest into
a slot (what its first request would do); with ``names`` (PEFT factor names) it returns the newest version's factors
under those names *as the LoRA kernels read them* — the slot buffers, not the registered copy — for the weight-sync
checks to compare bitwise, or with ``digests`` only their digests (:func:`trl_fp8.digest.tensor_digest`); with
``watch_routes`` it observes from then on which LoRA slot each token reads, and with ``routes`` it answers what it
observed since the last such request (:mod:`trl_fp8._trl.vllm_routing`).

``trl_fp8_stage_adapter(request)``: an adapter version sent as bytes (:mod:`trl_fp8._trl.adapter_staging`): ``op``
``chunk`` (``name``, ``offset``, base64 ``data``, total ``size``), ``commit`` (``size``, ``sha256``, the adapter's
``config``: answers the folder's path on this machine, for ``/v1/load_lora_adapter``) or ``drop``.

``trl_fp8_identity(request)``: the served identity of the worker's base (:mod:`trl_fp8.sync_checks.identity`): the
digest of every base tensor the learner names, as the worker computes with it, its dtype, quantization, tokenizer
and trl_fp8's version.
"""

from __future__ import annotations

import json


class AdapterWorker:
    def _trl_fp8_manager(self):
        manager = getattr(getattr(self.model_runner, "lora_manager", None), "_adapter_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM worker was started without LoRA (--enable-lora)")
        return manager

    def trl_fp8_lora_state(self, request: str) -> dict:
        from ..digest import tensor_digest
        from .vllm_lora import _locate, peft_to_vllm_name, slot_factor
        from .vllm_server_lora import encode_tensor

        from .vllm_routing import RouteGuard

        request = json.loads(request)
        manager = self._trl_fp8_manager()
        if request.get("watch_routes"):
            RouteGuard.install(manager)  # from the first push on: which slot each token reads
        ids = sorted(manager.list_adapters())
        latest = ids[-1] if ids else None
        if request.get("keep_latest") and latest is not None:
            for old in ids[:-1]:
                manager.remove_adapter(old)
            ids = sorted(manager.list_adapters())
        if latest is not None and latest not in manager.lora_index_to_id:
            manager.activate_adapter(latest)  # into a slot, as the first request for it would
        out = {"id": latest, "resident": ids, "slots": [i for i in manager.lora_index_to_id if i is not None],
               "tensors": {}, "digests": {}}
        if request.get("routes"):
            guard = getattr(manager, RouteGuard.ATTR, None)
            out["routes"] = guard.take() if guard is not None else \
                {"tokens": 0, "unreadable": "this worker was never asked to watch its LoRA slots (watch_routes)"}
        names = request.get("names") or []
        if names and latest is not None:
            adapter = request.get("adapter", "default")
            for name in names:
                where = _locate(manager, peft_to_vllm_name(name, adapter))
                tensor = None if where is None else slot_factor(manager, latest, where)
                if tensor is None:
                    continue
                if request.get("digests"):
                    out["digests"][name] = tensor_digest(tensor)
                else:
                    out["tensors"][name] = encode_tensor(tensor)
        return out

    def trl_fp8_stage_adapter(self, request: str) -> dict:
        import base64

        from .adapter_staging import Staging

        request = json.loads(request)
        staging = getattr(self, "_trl_fp8_staging", None)
        if staging is None:
            staging = self._trl_fp8_staging = Staging()
        op, name = request.get("op"), request.get("name", "")
        if op == "chunk":
            return staging.chunk(name, int(request["offset"]), base64.b64decode(request["data"]),
                                 int(request["size"]))
        if op == "commit":
            return staging.commit(name, int(request["size"]), str(request["sha256"]), dict(request["config"]))
        if op == "drop":
            staging.drop(name)
            return {}
        raise ValueError(f"trl_fp8_stage_adapter: unknown op {op!r} (chunk, commit, drop)")

    def trl_fp8_identity(self, request: str) -> dict:
        from ..engine_weights import engine_identity

        request = json.loads(request)
        config = self.model_runner.model_config
        tokenizer = None
        try:
            from vllm.tokenizers import cached_tokenizer_from_config

            tokenizer = cached_tokenizer_from_config(config)
        except Exception:  # noqa: BLE001 - no tokenizer to describe: the check compares the rest
            tokenizer = None
        return engine_identity(self.model_runner.model, request.get("names") or [], config.dtype,
                               config.quantization, tokenizer)
