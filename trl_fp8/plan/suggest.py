"""The one change that would make a plan fit: candidates tried cheapest first, each planned in full."""

from __future__ import annotations

from ..memory import bytes_text
from .devices import DEVICES
from .plan import make_spec, plan_for
from .spec import PlanSpec, Rollout


def suggest(model, args, options: dict, spec: PlanSpec, capabilities) -> str:
    """The first single change, cheapest first, after which the plan fits."""
    r = spec.rollout
    candidates = []
    if not spec.gradient_checkpointing:
        candidates.append(("gradient checkpointing on (--gradient-checkpointing)", {"gradient_checkpointing": True}))
    if spec.lora is not None and spec.lora_serving == "merged" and spec.vllm != "server":
        candidates.append(("serve the adapters, not a merged copy (--lora-serving adapters)",
                           {"lora_serving": "adapters"}))
    if spec.full and spec.optimizer == "adamw":
        candidates.append(("8-bit AdamW (--optim adamw_8bit)", {"optimizer": "adamw_8bit"}))
    if spec.full:
        candidates.append(("LoRA r=16 over a 16-bit base (--lora-r 16)", {"peft": 16, "base_dtype": None}))
    if spec.quant is None:
        candidates.append(("QLoRA: a 4-bit NF4 base with LoRA r=16 (--qlora)",
                           {"peft": options["peft"] or 16, "quantization": "nf4", "base_dtype": None}))
    if r.generation_batch > 1 or r.micro_batch > 1:
        half = {"micro_batch": max(1, r.micro_batch // 2), "generation_batch": max(1, r.generation_batch // 2),
                "prompt_length": r.prompt_length, "completion_length": r.completion_length}
        candidates.append((f"half the rows per step ({half['micro_batch']} per micro-batch, --batch-size "
                           f"{half['micro_batch']})", {"rollout": Rollout(**half)}))
    if r.completion_length > 128:
        shorter = Rollout(r.prompt_length, r.completion_length // 2, r.micro_batch, r.generation_batch)
        candidates.append((f"completions of {shorter.completion_length} tokens (--completion-length "
                           f"{shorter.completion_length})", {"rollout": shorter}))
    if spec.device.name == "t4" and spec.use_vllm:
        candidates.append(("2×T4 with the vLLM server on the second GPU (--device 2xt4 --vllm server)",
                           {"device": "2xt4", "vllm": "server"}))
    if spec.use_vllm:
        candidates.append(("generate in-process, without vLLM (--vllm off)", {"vllm": "off"}))
    for name in ("l4", "a100-40", "h100-80"):
        if DEVICES[name].usable > spec.device.usable:
            candidates.append((f"a bigger card: --device {name} ({DEVICES[name].note})", {"device": name}))
    for text, change in candidates:
        try:
            trial = plan_for(make_spec(model, args, **{**options, **change}), capabilities)
        except ValueError:
            continue
        if trial.fits:
            return f"{text}: {bytes_text(trial.total)} of {bytes_text(trial.totals[0]['usable'])}"
    return "no single change makes it fit on these cards"
