"""Fast QLoRA's trainer callback: its per-step counters, and the policy edits made for training only."""

from __future__ import annotations

from transformers import TrainerCallback


class FastQLoRACallback(TrainerCallback):
    def __init__(self, capability):
        self.capability = capability

    def on_train_begin(self, args, state, control, **kwargs):
        self.capability.redo()  # a second train() call after the edits were undone
        self.capability.counter.reset()

    def on_step_end(self, args, state, control, **kwargs):
        self.capability.record_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.capability.undo()  # the user's QLoRA policy again: 4-bit bases, every adapter trainable
