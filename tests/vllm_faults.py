"""Faults injected inside a `trl-fp8 vllm-serve` server's workers, for the tests (the SmolLM2 server fixture of
tests/test_vllm_server_adapters.py starts its workers with this extension): trl-fp8's own worker extension plus one
switch, ``trl_fp8_test_fault``, that nothing calls unless a test does — off, the server is the one users run."""

from __future__ import annotations

import json

from trl_fp8._trl.vllm_worker import AdapterWorker


class FaultWorker(AdapterWorker):
    def trl_fp8_test_fault(self, request: str) -> dict:
        """``{"misroute": true}``: from the next forward on, every token's LoRA slot index is set to "no slot" after
        vLLM builds the per-token metadata (a request naming the current version is computed by the bare base, while
        its name, its slot and the slot's factors all stay right); ``false``: vLLM's own build again."""
        from trl_fp8._trl.vllm_routing import language_punica_wrapper

        request = json.loads(request)
        manager = self._trl_fp8_manager()
        build = manager.__dict__.pop("_set_adapter_mapping", None)  # an earlier switch's wrapper: vLLM's method again
        if request.get("misroute"):
            original = manager._set_adapter_mapping

            def misroute(mapping):
                original(mapping)
                language_punica_wrapper(manager).token_lora_indices.fill_(-1)

            manager._set_adapter_mapping = misroute
        manager._last_mapping = None  # the next forward builds its metadata again (vLLM memoises the build)
        return {"misroute": bool(request.get("misroute")), "was_on": build is not None}
