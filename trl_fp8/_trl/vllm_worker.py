"""A vLLM worker extension for ``trl-fp8 vllm-serve`` (``--worker-extension-cls
trl_fp8._trl.vllm_worker.AdapterWorker``): what the trainer asks a server's workers through ``/collective_rpc``.

``trl_fp8_lora_state(request)`` (``request``: a JSON string, as ``/collective_rpc`` passes only strings): the newest
LoRA id the worker holds and every id resident in its cache; with ``keep_latest`` it first drops every other version
(vLLM's API server only forgets an unloaded name; its workers would keep it in their cache); with ``names`` (PEFT
factor names) it returns the newest version's factors under those names, as the worker computes with them (the
registered LoRA's tensors, packed modules split back), for the weight-sync checks to compare bitwise.
"""

from __future__ import annotations

import json


class AdapterWorker:
    def trl_fp8_lora_state(self, request: str) -> dict:
        from .vllm_lora import _locate, peft_to_vllm_name
        from .vllm_server_lora import encode_tensor

        request = json.loads(request)
        manager = getattr(getattr(self.model_runner, "lora_manager", None), "_adapter_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM worker was started without LoRA (--enable-lora)")
        ids = sorted(manager.list_adapters())
        latest = ids[-1] if ids else None
        if request.get("keep_latest") and latest is not None:
            for old in ids[:-1]:
                manager.remove_adapter(old)
            ids = sorted(manager.list_adapters())
        out = {"id": latest, "resident": ids, "tensors": {}}
        names = request.get("names") or []
        if names and latest is not None:
            model = manager.get_adapter(latest)
            adapter = request.get("adapter", "default")
            for name in names:
                where = _locate(manager, peft_to_vllm_name(name, adapter))
                if where is None:
                    continue
                module, index, is_a = where
                weights = model.get_lora(module)
                if weights is None:
                    continue
                tensor = weights.lora_a if is_a else weights.lora_b
                tensor = tensor[index] if isinstance(tensor, list) else tensor
                if tensor is not None:
                    out["tensors"][name] = encode_tensor(tensor)
        return out
