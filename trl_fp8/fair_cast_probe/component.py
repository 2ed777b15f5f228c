"""The Fair Cast probe as a trainer capability: with Fair Cast off, every ``fair_cast_probe`` optimizer steps it reads
a fixed sample of the trained fp32 weights before and after the step and records the share of the update that
round-to-nearest into the served dtype dropped (``fair_cast/rtn_dropped_frac``, :mod:`.core`). At the end of the run,
when the share stayed at or above :data:`ADVICE_SHARE` over the last readings, one line names it and the switch."""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from .. import _trl, sampling
from ..capability import Capability, check_int
from . import declaration
from .core import DroppedShare
from .declaration import FairCastProbeArgs  # noqa: F401 (re-exported)

logger = logging.getLogger("trl_fp8.fair_cast_probe")
ADVICE_SHARE = 0.5  # the share (mean of the last readings) from which the end-of-run line is printed
LAST = 5  # readings the advice is judged on
MIN_READINGS = 3


def advice(readings: list[tuple[int, float]], dtype_name: str, samples_16bit: bool) -> str | None:
    """The end-of-run line, or None: the mean of the last :data:`LAST` readings (at least :data:`MIN_READINGS`)
    at or above :data:`ADVICE_SHARE`."""
    last = readings[-LAST:]
    if len(last) < MIN_READINGS:
        return None
    share = sum(r for _, r in last) / len(last)
    if share < ADVICE_SHARE:
        return None
    steps = f"steps {last[0][0]}–{last[-1][0]}"
    if samples_16bit:
        where = (f"round-to-nearest into {dtype_name} dropped {share:.0%} of each step's update from the copy the "
                 f"sampler computes with (fair_cast/rtn_dropped_frac, mean of {len(last)} probes, {steps}): it reaches "
                 "the sampler only once the updates add up to a rounding boundary, so the sampler lags the learner")
    else:
        where = (f"round-to-nearest into {dtype_name} would drop {share:.0%} of each step's update from a 16-bit "
                 f"sampler's copy (fair_cast/rtn_dropped_frac, mean of {len(last)} probes, {steps}); this run samples "
                 "in fp32 and loses nothing now, but under bf16/fp16 autocast or vLLM its sampler would lag the "
                 "learner")
    return (f"trl_fp8: {where}. Fair Cast passes every update in expectation: fair_cast='stochastic'; "
            "fair_cast_probe=0 silences this probe.")


class FairCastProbe(Capability):
    name = "fair_cast_probe"
    Args = declaration.FairCastProbeArgs
    # reads each process's own values of its sampled elements: replicas (DDP, ZeRO-1/2) agree; sharded weights
    # (ZeRO-3, FSDP) hold no whole tensor to sample, and set-up turns the probe off there, saying why
    layouts = {"ddp": None, "deepspeed": None, "fsdp": None}
    off_hint = "fair_cast_probe=0"

    @classmethod
    def wanted(cls, args) -> bool:
        return declaration.wanted(args)

    @staticmethod
    def validate(args) -> None:
        check_int("fair_cast_probe", getattr(args, "fair_cast_probe", declaration.DEFAULT_EVERY), 0)

    def setup(self, trainer) -> bool:
        args = trainer.args
        trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        why = None
        if not trained:
            why = "nothing trains"
        elif getattr(trainer, "is_deepspeed_enabled", False):
            why = "DeepSpeed keeps the fp32 masters inside its optimizer, where the probe does not read"
        elif any(type(p).__name__ == "DTensor" or p.numel() == 0 or hasattr(p, "ds_id") for _, p in trained):
            why = "the trained weights are sharded (ZeRO-3 / FSDP): no process holds a whole tensor to sample"
        elif any(p.dtype != torch.float32 for _, p in trained):
            dtypes = sorted({str(p.dtype).removeprefix("torch.") for _, p in trained if p.dtype != torch.float32})
            why = (f"the trained weights are {', '.join(dtypes)}: the optimizer's update is rounded in the weights "
                   "themselves, with no fp32 master for Fair Cast to export from")
        if why is not None:
            logger.info("trl_fp8: the Fair Cast probe is off for this run: %s.", why)
            return False
        self.every = int(getattr(args, "fair_cast_probe", declaration.DEFAULT_EVERY))  # a plain TRL config: default
        self.dtype = torch.float16 if args.fp16 else torch.bfloat16
        # the sampler computes in 16 bits: autocast (the in-process generation), or a vLLM engine (bf16/fp16)
        self.samples_16bit = bool(args.bf16 or args.fp16 or sampling.vllm_mode(args) != "off")
        self.probe = DroppedShare(trained, self.dtype, seed=int(args.seed))
        self.readings: list[tuple[int, float]] = []
        trainer.add_callback(_ProbeCallback(self, trainer))
        return True

    def line(self) -> str | None:
        return advice(self.readings, str(self.dtype).removeprefix("torch."), self.samples_16bit)


class _ProbeCallback(TrainerCallback):
    def __init__(self, probe: FairCastProbe, trainer):
        self.probe, self.trainer = probe, trainer

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.probe.every == 0:
            self.probe.probe.begin()

    def on_step_end(self, args, state, control, **kwargs):
        share = self.probe.probe.end()
        if share is not None:
            self.probe.readings.append((state.global_step, share))
            _trl.record_metric(self.trainer, "fair_cast/rtn_dropped_frac", share)

    def on_train_end(self, args, state, control, **kwargs):
        line = self.probe.line()
        if line is not None and state.is_world_process_zero:
            logger.warning(line)
