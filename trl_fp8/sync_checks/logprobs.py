"""The in-process sampler's logprob of each token it samples, recorded during ``generate`` (as vLLM returns
them), so the logprob-agreement check costs no extra forward."""

from __future__ import annotations

import torch


class SampledLogprobTap:
    """Records the logits of each decoding step and reads the token that was sampled from them (the last column of
    the next step's ``input_ids``, or the completion itself for the final step): the sampled token's
    ``log softmax(logits / temperature)``. Steps are reduced in batches: the logits wait (up to
    :data:`BUFFER_BYTES`) and one ``log_softmax`` and one ``gather`` serve many steps, so that the per-step cost
    inside ``generate`` is one reference.

    transformers 5 runs user processors *before* its warpers (temperature, top-k, top-p), so the tap divides by
    the temperature itself: the same quantity TRL computes for the learner (temperature only).
    """

    BUFFER_BYTES = 16 * 2 ** 20  # logits held before the waiting steps are reduced

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)
        self._logits: list[torch.Tensor] = []  # the waiting steps' logits, [rows, vocab] each
        self._tokens: list[torch.Tensor] = []  # the token sampled from each waiting step but the last, [rows, 1]
        self._held = 0
        self._steps: list[torch.Tensor] = []  # reduced: [rows, k] float32 chunks

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """As a logits processor: ``scores`` is copied (later processors may change it in place)."""
        self._record(input_ids, scores.clone().unsqueeze(1))
        return scores

    def forward_hook(self, module, args, kwargs, output) -> None:
        """The same record taken as a forward hook on the generating model (``register_forward_hook(...,
        with_kwargs=True)``): each forward of ``generate`` sees the tokens sampled so far (the last column of its
        ``input_ids``: the whole prompt at prefill, the new token after it) and returns the next-token logits (the
        last position of its ``logits``), which ``generate`` copies before its processors run (so they are held
        without a copy). Both are kept as they come and sliced where the steps are reduced: this runs once per
        decoding step."""
        logits = getattr(output, "logits", None)
        if logits is None:
            if not isinstance(output, (tuple, list)) or not output:
                return
            logits = output[0]
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            if not args:
                return
            input_ids = args[0]
        self._record(input_ids, logits)

    def _record(self, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """``input_ids``: [rows, n] whose last column is the token sampled from the previous step; ``logits``:
        [rows, m, vocab] whose last position is this step's."""
        if self._logits:
            self._tokens.append(input_ids)
        self._logits.append(logits)
        self._held += logits.untyped_storage().nbytes()
        if self._held > self.BUFFER_BYTES and len(self._logits) > 1:
            self._reduce(len(self._logits) - 1)  # the last step's token is not known yet

    @staticmethod
    def _last(tensors: list[torch.Tensor]) -> torch.Tensor:
        """The last position of each along dim 1, joined along dim 1 (one ``cat`` when each has one position, as in
        decoding with a KV cache)."""
        if all(t.size(1) == 1 for t in tensors):
            return torch.cat(tensors, dim=1)
        return torch.cat([t[:, -1:] for t in tensors], dim=1)

    def _reduce(self, k: int) -> None:
        """The logprobs of the first ``k`` waiting steps' sampled tokens, as one ``[rows, k]`` chunk."""
        logits, self._logits = self._logits[:k], self._logits[k:]
        tokens, self._tokens = self._tokens[:k], self._tokens[k:]
        stacked = self._last(logits)  # [rows, k, vocab]
        if self.temperature != 1.0:
            stacked = stacked.float() / self.temperature
        index = self._last(tokens).to(stacked.device)
        # stays on the device: no host sync inside the decoding loop
        self._steps.append(torch.log_softmax(stacked, dim=-1, dtype=torch.float32).gather(2, index[..., None])
                           .squeeze(2))
        self._held = sum(t.untyped_storage().nbytes() for t in self._logits)

    def table(self, completions: list[list[int]]) -> torch.Tensor:
        """``[rows, steps]`` float32 logprobs of the sampled tokens, on the tap's device; 0 past a row's completion
        (each cut after its EOS, as TRL does)."""
        lengths = [len(c) for c in completions]
        if self._logits:  # the final step's token: no call followed it; it is the completion's
            if self._logits[-1].size(0) != len(completions):
                raise ValueError(f"the tap recorded {self._logits[-1].size(0)} rows for {len(completions)} "
                                 "completions")
            k = sum(chunk.size(1) for chunk in self._steps) + len(self._logits) - 1
            self._tokens.append(torch.tensor([[c[k] if n > k else 0] for c, n in zip(completions, lengths)],
                                             device=self._logits[-1].device))
            self._reduce(len(self._logits))
        if not self._steps:
            return torch.zeros(len(completions), 0)
        table = torch.cat(self._steps, dim=1) if len(self._steps) > 1 else self._steps[0]  # float32 [rows, steps]
        if table.size(0) != len(completions):
            raise ValueError(f"the tap recorded {table.size(0)} rows for {len(completions)} completions")
        if lengths and max(lengths) > table.size(1):
            raise ValueError("the recorded logprobs are shorter than a completion: generate() did not run the tap")
        ends = torch.tensor(lengths, device=table.device)
        return table.masked_fill(torch.arange(table.size(1), device=table.device)[None, :] >= ends[:, None], 0.0)

    def per_row(self, completions: list[list[int]]) -> list[list[float]]:
        """Logprobs of each row's sampled tokens, given the completions (each cut after its EOS, as TRL does)."""
        table = self.table(completions).cpu()
        return [table[i, : len(c)].tolist() for i, c in enumerate(completions)]
