"""The in-process sampler's logprob of each token it samples, recorded during ``generate`` (as vLLM returns
them), so the logprob-agreement check costs no extra forward."""

from __future__ import annotations

import torch


class SampledLogprobTap:
    """A logits processor that records ``log softmax(logits / temperature)`` at each decoding step and, at the
    next step, reads the token that was sampled (the last column of ``input_ids``). Holds one step at a time.

    transformers 5 runs user processors *before* its warpers (temperature, top-k, top-p), so the tap divides by
    the temperature itself: the same quantity TRL computes for the learner (temperature only).
    """

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)
        self._previous: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._collect(input_ids[:, -1])
        scaled = scores.float() if self.temperature == 1.0 else scores.float() / self.temperature
        self._previous = torch.log_softmax(scaled, dim=-1)  # a new tensor: later processors cannot change it
        return scores

    def forward_hook(self, module, args, kwargs, output) -> None:
        """The same record taken as a forward hook on the generating model (``register_forward_hook(...,
        with_kwargs=True)``): each forward of ``generate`` sees the tokens sampled so far (the last column of its
        ``input_ids``: the whole prompt at prefill, the new token after it) and returns the next-token logits."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
        if input_ids is None or logits is None:
            return
        self(input_ids, logits[:, -1, :])

    def _collect(self, tokens: torch.Tensor) -> None:
        if self._previous is not None:
            # stays on the device: no host sync inside the decoding loop
            self._steps.append(self._previous.gather(1, tokens.unsqueeze(1).to(self._previous.device)).squeeze(1))
            self._previous = None

    def table(self, completions: list[list[int]]) -> torch.Tensor:
        """``[rows, steps]`` float32 logprobs of the sampled tokens, on the tap's device; 0 past a row's completion
        (each cut after its EOS, as TRL does)."""
        if self._previous is not None:  # the final step's token: no processor call followed it
            k = len(self._steps)
            self._collect(torch.tensor([c[k] if len(c) > k else 0 for c in completions],
                                       device=self._previous.device))
        if not self._steps:
            return torch.zeros(len(completions), 0)
        table = torch.stack(self._steps, dim=1).float()
        if table.size(0) != len(completions):
            raise ValueError(f"the tap recorded {table.size(0)} rows for {len(completions)} completions")
        if any(len(c) > table.size(1) for c in completions):
            raise ValueError("the recorded logprobs are shorter than a completion: generate() did not run the tap")
        lengths = torch.tensor([len(c) for c in completions], device=table.device)
        return table.masked_fill(torch.arange(table.size(1), device=table.device)[None, :] >= lengths[:, None], 0.0)

    def per_row(self, completions: list[list[int]]) -> list[list[float]]:
        """Logprobs of each row's sampled tokens, given the completions (each cut after its EOS, as TRL does)."""
        table = self.table(completions).cpu()
        return [table[i, : len(c)].tolist() for i, c in enumerate(completions)]
