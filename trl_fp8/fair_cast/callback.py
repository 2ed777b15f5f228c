"""Fair Cast's hooks into the optimizer step of a transformers ``Trainer`` (no TRL imports)."""

from __future__ import annotations

from transformers import TrainerCallback

from .served import ServedCopy


class FairCastCallback(TrainerCallback):
    """Swap master and served values around every optimizer step; collect the export metrics.

    ``on_pre_optimizer_step`` puts the fp32 master into the parameters (the optimizer steps the master with
    the gradient computed on the served values); ``on_optimizer_step`` re-exports and puts the served values
    back. Metrics of each export are appended to ``self.pending`` (name -> list of floats).
    """

    def __init__(self, served: ServedCopy):
        self.served = served
        self.restored = False
        self.pending: dict[str, list[float]] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.served.begin(step=state.global_step, restored=self.restored)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.served.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        for name, value in self.served.after_step(state.global_step + 1).items():
            self.pending.setdefault(f"fair_cast/{name}", []).append(value)

    def pop_metrics(self) -> dict[str, float]:
        """Mean of each pending metric since the last call, and clear them."""
        out = {k: sum(v) / len(v) for k, v in self.pending.items() if v}
        self.pending.clear()
        return out
