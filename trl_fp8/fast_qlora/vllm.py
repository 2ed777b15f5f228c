"""Fast QLoRA with TRL's vLLM sampler: a 16-bit engine sent ``dequant(W) + ΔW``.

TRL 1.16 starts a colocated engine with ``quantization="bitsandbytes"`` for a 4-bit policy and syncs by merging the
adapters into the 4-bit weights (lossy: a small adapter changes no 4-bit code, and every merge/unmerge drifts the
base) and pushing packed uint8 without its quantization state. With fast QLoRA the engine is started without
quantization (the sampling decision's engine, built by :func:`trl_fp8._trl.engine_context`: it then loads the checkpoint's 16-bit weights) and each sync
sends the dense merged weights in the engine's dtype: the 4-bit weights are never touched. TRL's own
``sync_weights`` does the pushing; only its stream is replaced, on the instance.
"""

from __future__ import annotations

from .. import _trl
from ..numerics import torch_dtype


class QLoRAVLLMExport(_trl.DenseVLLMStream):
    """``stream()``: ``(served name, tensor in the engine dtype)``, what the weight-sync checks hold the engine to."""

    def __init__(self, generation, capability):
        super().__init__(generation, lambda: capability.export_stream(self.dtype()))
        self.capability = capability
        self._dtype = None

    def dtype(self):
        """The engine's dtype (what the stream is cast to, so nothing rounds it again on the way)."""
        if self._dtype is None:
            quantization = _trl.vllm_engine_quantization(self.generation)
            if quantization:
                raise ValueError(
                    f"fast QLoRA sends 16-bit dequant(W) + ΔW weights, but the vLLM engine was started with "
                    f"quantization={quantization!r}. Start it without quantization (trl_fp8.GRPOTrainer does so for "
                    "colocate mode; for `trl vllm-serve`, do not pass --quantization)."
                )
            name = _trl.vllm_engine_dtype(self.generation)
            self._dtype = torch_dtype(name) if name is not None else None
        return self._dtype

    def check_engine(self) -> None:
        self.dtype()
