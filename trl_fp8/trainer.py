"""``trl_fp8.GRPOTrainer``: ``trl.GRPOTrainer`` with trl_fp8's capabilities composed in.

With every trl_fp8 field of :class:`trl_fp8.GRPOConfig` at its default, training is TRL's, step for step
(``tests/test_trainer.py`` proves it bit for bit on CPU). Capabilities hook in through the narrowest
overrides; each says which TRL version it mirrors.
"""

from __future__ import annotations

import copy
import os

import torch
from trl import GRPOTrainer as _TRLGRPOTrainer

from .config import GRPOConfig
from .report import MetricsJsonlCallback

FAIR_CAST_STATE = "fair_cast_state.pt"


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


class GRPOTrainer(_TRLGRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer`; takes the same arguments.

    ``args`` may be a :class:`trl_fp8.GRPOConfig` or a plain :class:`trl.GRPOConfig` (or None, as in TRL);
    with a plain TRL config every trl_fp8 capability is off.
    """

    _tag_names = ["trl", "grpo", "trl-fp8"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._fair_cast = None
        self._served_model = None
        if getattr(self.args, "fair_cast", "off") != "off":
            self._setup_fair_cast()
        metrics_jsonl = getattr(self.args, "metrics_jsonl", None)
        if metrics_jsonl:
            self.add_callback(MetricsJsonlCallback(metrics_jsonl))

    # -- Fair Cast ---------------------------------------------------------------------------------------------
    def _setup_fair_cast(self) -> None:
        from .fair_cast.callback import FairCastCallback
        from .fair_cast.rounding import SERVED_DTYPES
        from .fair_cast.served import ParamUnit, ServedCopy

        model = self.accelerator.unwrap_model(self.model)
        dtype = SERVED_DTYPES[self.args.served_dtype]
        if _is_peft_model(model):
            from .fair_cast.peft import lora_units

            units = lora_units(model)
        else:
            units = [ParamUnit(n, p) for n, p in model.named_parameters()]
        served_tensors = None
        if not self.use_vllm:
            # The in-process sampler: a twin of the policy (merged, for LoRA) whose parameters *are* the served
            # tensors; buffers stay as they are (e.g. rotary frequencies in fp32, as inference engines keep them).
            twin = copy.deepcopy(model).merge_and_unload() if _is_peft_model(model) else copy.deepcopy(model)
            for p in twin.parameters():
                p.data = p.data.to(dtype)
                p.requires_grad_(False)
            twin.eval()
            served_tensors = dict(twin.named_parameters())
            unit_names = {u.name for u in units}
            if unit_names != set(served_tensors):
                raise ValueError(
                    "Fair Cast could not match the learner's parameters to the served model's: only in the "
                    f"learner {sorted(unit_names - set(served_tensors))[:5]}, only served "
                    f"{sorted(set(served_tensors) - unit_names)[:5]}."
                )
            self._served_model = twin
        served = ServedCopy(units, self.args.fair_cast, dtype, self.args.resolved_fair_cast_seed(),
                            served_tensors=served_tensors)
        if self.use_vllm:
            from .fair_cast.vllm import FairCastVLLMGeneration

            FairCastVLLMGeneration.adopt(self.vllm_generation, served)  # TRL's sync now streams the served copy
        self._fair_cast = FairCastCallback(served)
        self.add_callback(self._fair_cast)

    # Mirrors trl 1.16 GRPOTrainer._generate_single_turn: with Fair Cast and the in-process sampler, generate
    # with the served twin instead of the fp32 learner; everything else is TRL's code path.
    def _generate_single_turn(self, *args, **kwargs):
        if self._served_model is None or self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*args, **kwargs)
        learner = self.model_wrapped
        self.model_wrapped = self._served_model
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            self.model_wrapped = learner

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._fair_cast is not None and self.model.training:
            logs.update(self._fair_cast.pop_metrics())
        super().log(logs, start_time)

    # Mirrors trl 1.16 GRPOTrainer._save_checkpoint (which writes extra state after the base checkpoint).
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._fair_cast is not None and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            path = os.path.join(folder, FAIR_CAST_STATE)
            tmp = path + ".tmp"
            torch.save(self._fair_cast.served.state_dict(), tmp)
            os.replace(tmp, path)  # never a half-written state file

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._fair_cast is None or checkpoint is None:
            return
        path = os.path.join(checkpoint, FAIR_CAST_STATE)
        if not os.path.isfile(path):
            raise ValueError(
                f"Resuming with fair_cast={self.args.fair_cast!r} from {checkpoint}, which has no {FAIR_CAST_STATE} "
                "(it was not written by a Fair Cast run): the fp32 master cannot be restored. Resume with the "
                "fair_cast setting the checkpoint was written with."
            )
        self._fair_cast.served.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self._fair_cast.restored = True
