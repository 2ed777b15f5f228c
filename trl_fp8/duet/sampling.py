"""DUET's early stop inside ``transformers.generate``: a stopping criterion that runs one
:class:`~trl_fp8.duet.abort.RolloutMonitor` per row (no TRL imports).

Called after every decoding step with the sequences so far, and fed the processed next-token scores by its
companion logits processor (:attr:`DuetStoppingCriteria.scores_tap`, appended after ``generate``'s own
processors; ``generate`` only hands scores to stopping criteria when it stores them all), it reads the
sampled token's log-probability (summed per row: the surrogate's ``Σ log π``), the top-1 minus top-2 probability
margin, and every ``poll_every`` tokens the decoded tail for answer markers. Rows it stops produce no further
tokens (``generate`` pads them and ends when every row is done).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, StoppingCriteria

TAIL_TOKENS = 64  # decoded tail polled for markers


class _ScoresTap(LogitsProcessor):
    """Keeps the latest processed scores for the stopping criterion; changes nothing."""

    def __init__(self):
        self.scores = None

    def __call__(self, input_ids, scores):
        self.scores = scores
        return scores


class DuetStoppingCriteria(StoppingCriteria):
    def __init__(self, monitors, tokenizer, eos_token_ids, poll_every: int = 8):
        self.monitors = monitors
        self.tokenizer = tokenizer
        self.prompt_length = None  # the padded prompt length: the sequence length at the first call, less one
        self.eos = torch.tensor(list(eos_token_ids), dtype=torch.long)
        self.poll_every = poll_every
        n = len(monitors)
        self.sum_logps = torch.zeros(n, dtype=torch.float64)
        self.stop_at = [None] * n  # number of completion tokens kept by a DUET stop/abort
        self.finished = torch.zeros(n, dtype=torch.bool)  # ended by EOS
        self.scores_tap = _ScoresTap()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if self.prompt_length is None:  # called once per decoding step, first with one new token
            self.prompt_length = input_ids.shape[1] - 1
        t = input_ids.shape[1] - self.prompt_length
        last = input_ids[:, -1].cpu()
        probs = torch.softmax(self.scores_tap.scores.float(), dim=-1).cpu()
        top2 = probs.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        token_logp = torch.log(probs.gather(1, last.unsqueeze(1)).squeeze(1).clamp_min(1e-30)).double()
        active = ~(self.finished | self._stopped())  # rows that generated this token
        self.sum_logps += torch.where(active, token_logp, torch.zeros_like(token_logp))
        self.finished |= active & torch.isin(last, self.eos)
        poll = t % self.poll_every == 0
        start = max(self.prompt_length, input_ids.shape[1] - TAIL_TOKENS)
        for i in (active & ~self.finished).nonzero().flatten().tolist():
            tail = self.tokenizer.decode(input_ids[i, start:], skip_special_tokens=True) if poll else None
            monitor = self.monitors[i]
            monitor.step(t, margins[i], tail)
            if monitor.done:
                self.stop_at[i] = t
        return (self.finished | self._stopped()).to(input_ids.device)

    def _stopped(self) -> torch.Tensor:
        return torch.tensor([s is not None for s in self.stop_at], dtype=torch.bool)
