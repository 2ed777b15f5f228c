"""Fair Cast's hooks into the optimizer step of a transformers ``Trainer`` (no TRL imports)."""

from __future__ import annotations

from collections.abc import Callable

from transformers import TrainerCallback

from .served import ServedCopy


class FairCastCallback(TrainerCallback):
    """Swap master and served values around every optimizer step; record the export metrics.

    ``on_pre_optimizer_step`` puts the fp32 master into the parameters (the optimizer steps the master with
    the gradient computed on the served values); ``on_optimizer_step`` re-exports, puts the served values
    back and passes each export metric to ``record(name, value)`` as ``fair_cast/<metric>``.
    """

    def __init__(self, served: ServedCopy, record: Callable[[str, float], None]):
        self.served = served
        self.record = record
        self.restored = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.served.begin(step=state.global_step, restored=self.restored)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.served.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        for name, value in self.served.after_step(state.global_step + 1).items():
            self.record(f"fair_cast/{name}", value)
