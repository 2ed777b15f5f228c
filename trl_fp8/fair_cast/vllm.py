"""Fair Cast glue for TRL's vLLM sampler (colocate and server modes).

TRL 1.16 pushes ``param.data`` of the fp32 learner to vLLM, whose ``load_weights`` then rounds it to the
engine dtype (RTN) — in server mode the tensors travel in fp32 and are cast on the server. With Fair Cast the
push must carry the exported low-precision tensors instead, and nothing downstream may round again: the
pushed tensors are already in ``served_dtype`` and the engine must run in that dtype (checked at the first
sync), so vLLM's copy into its parameters is exact. TRL's own ``sync_weights`` does the pushing; only its stream
is replaced, on the instance (:func:`trl_fp8._trl.set_vllm_stream`).
"""

from __future__ import annotations

from .. import _trl
from ..numerics import dtype_name
from .served import ServedCopy


class VLLMExport(_trl.DenseVLLMStream):
    """The stream TRL's sync sends with Fair Cast: the served tensors under TRL's vLLM names."""

    def __init__(self, generation, served: ServedCopy, stream=None):
        super().__init__(generation, stream if stream is not None else (lambda: iter(served.served.items())))
        self.served = served

    def check_engine(self) -> None:
        engine = _trl.vllm_engine_dtype(self.generation)
        served = dtype_name(self.served.dtype)
        if engine is not None and engine != served:
            raise ValueError(
                f"Fair Cast serves {served} weights, but the vLLM engine runs in {engine}: loading would round "
                f"them again. Start vLLM with dtype={served!r} (server: `--dtype {served}`) or set served_dtype="
                f"{engine!r}."
            )

    def check_tensor(self, name, tensor) -> None:
        if tensor.dtype != self.served.dtype:  # the guard: no implicit RTN downstream of the export
            raise AssertionError(f"Fair Cast would push '{name}' as {tensor.dtype}, not {self.served.dtype}")
