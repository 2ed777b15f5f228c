"""Fair Cast glue for TRL's vLLM sampler (colocate and server modes).

TRL 1.16 pushes ``param.data`` of the fp32 learner to vLLM, whose ``load_weights`` then rounds it to the
engine dtype (RTN) — in server mode the tensors travel in fp32 and are cast on the server. With Fair Cast the
push must carry the exported low-precision tensors instead, and nothing downstream may round again: the
pushed tensors are already in ``served_dtype`` and the engine must run in that dtype (checked at the first
sync), so vLLM's copy into its parameters is exact.
"""

from __future__ import annotations

from trl.generation.vllm_generation import VLLMGeneration

from .served import ServedCopy


def _dtype_name(value) -> str:
    return str(value).removeprefix("torch.")


class FairCastVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` whose weight sync streams the served copy (mirrors trl 1.16)."""

    served: ServedCopy
    _engine_checked: bool = False

    @classmethod
    def adopt(cls, generation: VLLMGeneration, served: ServedCopy) -> FairCastVLLMGeneration:
        """Turn TRL's already initialised sampler (engine or client included) into this class."""
        generation.__class__ = cls
        generation.served = served
        generation._engine_checked = False
        return generation

    def engine_dtype(self) -> str | None:
        """The dtype the vLLM engine computes in, or None when it cannot be read."""
        if self.mode == "colocate":
            config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
            return _dtype_name(config.dtype) if config is not None else None
        if self.accelerator.is_main_process:
            return _dtype_name(self.vllm_client.get_server_info()["model_config"]["dtype"])
        return None

    def check_engine_dtype(self) -> None:
        engine = self.engine_dtype()
        served = _dtype_name(self.served.dtype)
        if engine is not None and engine != served:
            raise ValueError(
                f"Fair Cast serves {served} weights, but the vLLM engine runs in {engine}: loading would round "
                f"them again. Start vLLM with dtype={served!r} (server: `--dtype {served}`) or set served_dtype="
                f"{engine!r}."
            )
        self._engine_checked = True

    # Mirrors trl 1.16 VLLMGeneration._iter_named_params: same names, but the served tensors.
    def _iter_named_params(self):
        if getattr(self, "served", None) is None:  # no Fair Cast: TRL's own stream
            yield from super()._iter_named_params()
            return
        if not self._engine_checked:
            self.check_engine_dtype()
        for name, tensor in self.served.served.items():
            if tensor.dtype != self.served.dtype:  # the guard: no implicit RTN downstream of the export
                raise AssertionError(f"Fair Cast would push '{name}' as {tensor.dtype}, not {self.served.dtype}")
            yield self._fix_param_name_to_vllm(name), tensor

