"""``trl_fp8.GRPOTrainer``: ``trl.GRPOTrainer`` with trl_fp8's capabilities composed in.

With every trl_fp8 field of :class:`trl_fp8.GRPOConfig` at its default, training is TRL's, step for step
(``tests/test_trainer.py`` proves it bit for bit on CPU). Capabilities hook in through the narrowest
overrides; each says which TRL version it mirrors.
"""

from __future__ import annotations

from trl import GRPOTrainer as _TRLGRPOTrainer

from .config import GRPOConfig
from .report import MetricsJsonlCallback


class GRPOTrainer(_TRLGRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer`; takes the same arguments.

    ``args`` may be a :class:`trl_fp8.GRPOConfig` or a plain :class:`trl.GRPOConfig` (or None, as in TRL);
    with a plain TRL config every trl_fp8 capability is off.
    """

    _tag_names = ["trl", "grpo", "trl-fp8"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        metrics_jsonl = getattr(self.args, "metrics_jsonl", None)
        if metrics_jsonl:
            self.add_callback(MetricsJsonlCallback(metrics_jsonl))
