"""The marker-gated abort rule for one rollout (DUET axis 2), as a small state machine fed token by token.

- Before ``k1`` tokens: free generation, nothing stops the rollout.
- Once an answer marker has been seen (polled on the decoded tail every ``poll_every`` tokens) the rollout is
  kept, and a confidence trim arms -- except, with probability ``trim_skip_prob``, for this rollout: from ``k1``
  on, when the top-1 minus top-2 probability margin exceeds ``margin_threshold`` for ``patience`` consecutive
  tokens, the rollout stops.
- No marker by ``k2 + grace`` tokens: abort with probability ``1 - keep_prob`` (no gradient), else run to the end
  as an *ε-kept* rollout whose weight is ``1 / keep_prob``.
A confidence rule without the marker gate collapsed hard-math accuracy in the source paper: the gate is the point.
"""

from __future__ import annotations

import enum
import random

from .markers import MarkerDetector


class Action(enum.Enum):
    CONTINUE = "continue"
    STOP = "stop"  # confidence trim after a marker: keep the rollout, generate no more
    ABORT = "abort"  # no marker: drop the rollout from the gradient, generate no more


class RolloutMonitor:
    def __init__(self, detector: MarkerDetector, k1: float, k2: float, rng: random.Random,
                 margin_threshold: float = 0.9, keep_prob: float = 0.05, trim_skip_prob: float = 0.05,
                 patience: int = 5, grace: int = 150, poll_every: int = 8):
        self.detector = detector
        self.k1, self.k2 = k1, k2
        self.rng = rng
        self.margin_threshold = margin_threshold
        self.keep_prob, self.trim_skip_prob = keep_prob, trim_skip_prob
        self.patience, self.grace, self.poll_every = patience, grace, poll_every
        self.has_marker = False
        self.trim_armed = False
        self.confident_run = 0
        self.decided = False  # the no-marker coin has been tossed
        self.eps_kept = False
        self.aborted = False
        self.stopped = False

    @property
    def done(self) -> bool:
        return self.aborted or self.stopped

    def step(self, t: int, margin: float, tail_text: str | None = None) -> Action:
        """Token number ``t`` (1-based) was just generated with top-1/top-2 ``margin``; ``tail_text`` is the
        decoded tail, needed on polling tokens (``t % poll_every == 0``)."""
        if self.done:
            return Action.STOP if self.stopped else Action.ABORT
        if not self.has_marker and t % self.poll_every == 0 and tail_text is not None:
            if self.detector.found(tail_text):
                self.has_marker = True
                self.trim_armed = self.rng.random() >= self.trim_skip_prob
        if t < self.k1:
            return Action.CONTINUE
        if self.has_marker:
            if self.trim_armed:
                self.confident_run = self.confident_run + 1 if margin > self.margin_threshold else 0
                if self.confident_run >= self.patience:
                    self.stopped = True
                    return Action.STOP
            return Action.CONTINUE
        if not self.decided and t >= self.k2 + self.grace:
            self.decided = True
            if self.rng.random() < 1.0 - self.keep_prob:
                self.aborted = True
                return Action.ABORT
            self.eps_kept = True
        return Action.CONTINUE
