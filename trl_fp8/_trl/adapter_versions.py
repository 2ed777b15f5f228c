"""What the two adapter-version streams share (:class:`~trl_fp8._trl.vllm_lora.VLLMLoraStream` to a colocated
engine, :class:`~trl_fp8._trl.vllm_server_lora.VLLMServerLoraStream` to a server): TRL's side of a sync, the bounded
history of pushes, the tensors last sent, and the count of which version each finished rollout was generated with.

A subclass says *how* a version reaches its engine (:meth:`AdapterVersionStream.push`) and hooks its engine or client
so that every request asks for the current version and every finished one is counted
(:meth:`AdapterVersionStream._count_generated`).
"""

from __future__ import annotations

import collections

import torch

PUSH_HISTORY = 8  # pushes kept in memory (labels, ids, names): bounded, whatever the run's length


class AdapterVersionStream:
    """TRL's ``_iter_named_params`` and ``sync_weights`` on one ``generation`` instance, as LoRA versions.

    ``stream()``: ``(PEFT name, factor in the engine's dtype)`` with the scaling folded into B; ``version_fn()``: the
    label of a push (e.g. the learner's step; None: no label)."""

    def __init__(self, generation, stream, spec, version_fn=None):
        self.generation = generation
        self.stream = stream
        self.spec = spec
        self.version_fn = version_fn
        self.pushes: collections.deque = collections.deque(maxlen=PUSH_HISTORY)  # the latest pushes only
        self.push_count = 0
        self.last_sent: dict[str, torch.Tensor] = {}  # PEFT name -> the last push's tensors, as sent (CPU copies)
        self.generated: collections.Counter = collections.Counter()  # version -> finished rollouts generated with it
        self._unread: collections.Counter = collections.Counter()  # generated since the last rollout_versions()

    # -- TRL's side ----------------------------------------------------------------------------------------------
    def __call__(self):
        """TRL's ``_iter_named_params`` on this instance: the adapter factors (what the checks' tap records)."""
        yield from self.stream()

    def sync(self) -> None:
        """TRL's ``sync_weights`` on this instance: the stream (through ``_iter_named_params``, so a wrapper's tap
        sees it) pushed as a new LoRA version. No ``merge_adapter``, no dense tensor."""
        version = self.version_fn() if self.version_fn is not None else None
        self.push(self.generation._iter_named_params(), version)

    def push(self, named, version=None):
        """Make ``named`` (PEFT names -> factors) the version every request asks for."""
        raise NotImplementedError

    # -- what the rollouts were generated with --------------------------------------------------------------------
    def _count_generated(self, version, n: int = 1) -> None:
        self.generated[version] += n
        self._unread[version] += n

    # -- which LoRA slot each token read (:mod:`trl_fp8._trl.vllm_routing`) ------------------------------------------
    def watch_routes(self) -> None:
        """Observe, from now on, the LoRA slot each token the engine computes reads (before the first rollout)."""

    def routes(self) -> dict | None:
        """The tokens computed since the last call against their requests' slots, then forgotten; None: not
        observed."""
        return None

    def label_of(self, lora_id: int):
        """The version label an engine LoRA id was pushed under (None: not one this stream pushed)."""
        return None

    def rollout_versions(self) -> collections.Counter:
        """The versions the rollouts finished since the last call were generated with (None: the bare base; a
        label this stream never pushed says so), and how many of each; then forgets them."""
        out, self._unread = self._unread, collections.Counter()
        return out
