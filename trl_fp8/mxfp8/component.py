"""MXFP8 as a trainer capability: its config fields, the conversion of the policy (and KL reference) at start,
and the specs of the layers it quantizes (what the weight-sync checks hold the sampler to)."""

from __future__ import annotations

import re

from .. import fourbit
from ..capability import Capability, Conflict, check_choice
from .convert import KERNELS, MXRecipe, convert_linears, linear_specs, resolve_kernel
from . import declaration
from .declaration import MXFP8Args  # noqa: F401 (re-exported)




class MXFP8(Capability):
    name = "mxfp8"
    Args = MXFP8Args
    resume_fields = ("mxfp8", "mxfp8_exclude")  # the kernel may change: emulated and SM100 compute alike
    layouts = {
        "ddp": None,  # each replica converts the same linears; DDP all-reduces the fp32 master gradients
        "deepspeed": {1: None, 2: None,
                      3: "torchao's MXFP8 linears over ZeRO-3's partitioned parameters have not been made to work"},
        "fsdp": "torchao's MXFP8 linears over FSDP shards (an MX all-gather) have not been made to work",
    }
    off_hint = "mxfp8=False"
    conflicts = (Conflict("use_transformers_continuous_batching", "TRL's continuous-batching path does not run the "
                          "MXFP8 linears' sampler."),)

    @classmethod
    def wanted(cls, args) -> bool:
        return declaration.wanted(args)

    @staticmethod
    def validate(args) -> None:
        if not isinstance(args.mxfp8, bool):
            raise ValueError(f"mxfp8 must be True or False, got {args.mxfp8!r}.")
        check_choice("mxfp8_kernel", args.mxfp8_kernel, KERNELS)
        if isinstance(args.mxfp8_exclude, str):
            args.mxfp8_exclude = [p for p in args.mxfp8_exclude.split(",") if p]
        exclude = args.mxfp8_exclude
        if not isinstance(exclude, (list, tuple)) or not all(isinstance(p, str) for p in exclude):
            raise ValueError(f"mxfp8_exclude must be a list of regular expressions, got {exclude!r}.")
        for pattern in exclude:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"mxfp8_exclude: {pattern!r} is not a valid regular expression ({err}).") from None
        if not args.mxfp8:
            return
        if args.use_vllm:
            raise ValueError(
                "mxfp8=True is supported with the in-process sampler only for now: a vLLM sampler would need "
                "quantization='mxfp8' and a sync through vLLM's quantized-weight reload (TRL 1.16's load_weights "
                "skips it), and vLLM-CPU has no MXFP8 to test it against. Use use_vllm=False."
            )
        if args.fp16:
            raise ValueError("mxfp8=True computes its GEMMs from bf16/fp32 inputs; use bf16=True or fp32, not fp16=True.")

    def setup(self, trainer) -> bool:
        args = trainer.args
        model = trainer.accelerator.unwrap_model(trainer.model)
        if fourbit.has_4bit(model) or fourbit.has_8bit(model):
            raise ValueError(
                "mxfp8=True with a bitsandbytes-quantized (4-bit/8-bit) policy is not supported: MXFP8 quantizes dense "
                "linear layers, and a quantized base has none. Load the model in 16/32-bit for MXFP8, or use "
                "fast_qlora without mxfp8."
            )
        self.recipe = MXRecipe(rounding="rceil", kernel=resolve_kernel(args.mxfp8_kernel))
        self.report = convert_linears(model, self.recipe, args.mxfp8_exclude)
        if trainer.ref_model is not None:  # the KL reference computes like the policy
            convert_linears(trainer.accelerator.unwrap_model(trainer.ref_model), self.recipe, args.mxfp8_exclude,
                            strict=False)
        return True

    def held_tensors(self) -> dict:
        """None: the converted layers compute with the linears' own parameters (see :mod:`trl_fp8.mxfp8.memory`)."""
        return {"mxfp8/state": []}

    def describe(self, model):
        """Every linear weight: its MXFP8 spec as the module computes it, or dense ``excluded``."""
        return linear_specs(model)
