"""The one change that would make a plan fit (candidates tried cheapest first, each planned in full), and
:func:`memory_plan`, the plan with that suggestion when it does not fit (here, so that :mod:`.plan` never imports
this module)."""

from __future__ import annotations

from ..memory import bytes_text
from .devices import DEVICES
from .plan import Plan, _Args, make_spec, plan_for, run_args
from .spec import PlanSpec, Rollout


def _with(args, **fields):
    """``args`` (a ``GRPOConfig``, a dict of its fields, a plan's settings or None) with ``fields`` changed."""
    if args is None or isinstance(args, dict):
        return {**(args or {}), **fields}
    if isinstance(args, _Args):
        return _Args(**{**vars(args), **fields})
    return run_args(args, **fields)


def suggest_change(model, args, options: dict, spec: PlanSpec, capabilities) -> str:
    """The first single change, cheapest first, after which the plan fits."""
    r = spec.rollout
    candidates = []
    # trl_fp8's own switches first: what the run adds over TRL, dropped or made cheaper, keeps the method and the card
    # (serving the adapters keeps every capability on: tried before any is dropped)
    if spec.lora is not None and spec.lora_serving == "merged":  # a trl-fp8 vllm-serve server serves adapters too
        candidates.append(("serve the adapters, not a merged copy (--lora-serving adapters)",
                           {"lora_serving": "adapters"}))
    a = spec.args
    fair_cast = getattr(a, "fair_cast", "off")
    if fair_cast == "error_feedback":
        candidates.append(("Fair Cast stochastic rounding instead of error feedback (--fair-cast stochastic)",
                           {"args": _with(args, fair_cast="stochastic")}))
    if fair_cast != "off":
        candidates.append(("Fair Cast off (--fair-cast off)", {"args": _with(args, fair_cast="off")}))
    if getattr(a, "sync_checks", "off") not in ("off", (), []):
        candidates.append(("weight-sync checks off (--sync-checks off)", {"args": _with(args, sync_checks="off")}))
    if not spec.gradient_checkpointing:
        candidates.append(("gradient checkpointing on (--gradient-checkpointing)", {"gradient_checkpointing": True}))
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
    bigger = sorted((d for d in DEVICES.values() if d.gpus == 1 and d.usable > spec.device.usable),
                    key=lambda d: d.usable)
    for device in bigger:
        candidates.append((f"a bigger card: --device {device.name} ({device.note})", {"device": device.name}))
    for text, change in candidates:
        change = dict(change)
        trial_args = change.pop("args", args)
        try:
            trial = plan_for(make_spec(model, trial_args, **{**options, **change}), capabilities)
        except ValueError:
            continue
        if trial.fits:
            return f"{text}: {bytes_text(trial.total)} of {bytes_text(trial.totals[0]['usable'])}"
    return "no single change makes it fit on these cards"


def memory_plan(model, args=None, *, peft=None, quantization=None, device="t4", rollout=None, base_dtype=None,
                lora_serving=None, optimizer=None, vllm=None, gradient_checkpointing=None, chunked_logits=True,
                precision=None, prompt_length=None, capabilities=None, suggest=True) -> Plan:
    """The memory plan of a GRPO run.

    Args:
        model: a name from :data:`trl_fp8.plan.MODELS` (``"qwen2.5-7b"``, ``"Qwen/Qwen2.5-7B-Instruct"``, ...), a
            ``config.json`` path, a folder holding one, a ``transformers.PretrainedConfig`` or an :class:`Arch`.
        args: the run's ``trl_fp8.GRPOConfig`` (or a dict of its fields); None: every field at its default.
            Read: Fair Cast, the weight-sync checks, DUET, fast QLoRA, MXFP8, ``lora_serving``, ``use_vllm`` /
            ``vllm_mode`` / ``vllm_gpu_memory_utilization``, ``gradient_checkpointing``,
            ``per_device_train_batch_size``, ``steps_per_generation`` / ``gradient_accumulation_steps``,
            ``max_completion_length``, ``optim``, ``beta``, ``precision``, ``model_init_kwargs["dtype"]``. Use
            :data:`FREE_TIER` for the free-tier recipe.
        peft: None (full fine-tuning), a LoRA rank, ``{"r": 16, "target_modules": [...]}`` or a ``peft.LoraConfig``
            (default targets: "all-linear", every block linear of the model).
        quantization: None, ``"nf4"`` (bitsandbytes NF4 with double quantization, blocks of 64), a dict or a
            ``transformers.BitsAndBytesConfig`` (``load_in_4bit``); needs ``peft`` (QLoRA).
        device: ``"t4"``, ``"2xt4"``, ``"l4"``, ``"a100-40"``, ``"h100-80"``, a byte count or a :class:`Device`.
        rollout: a :class:`Rollout` or a dict (``prompt_length``, ``completion_length``, ``micro_batch``,
            ``generation_batch``); default from ``args`` and a 256-token prompt.
        base_dtype: the loaded weights' dtype (default: float32 for full fine-tuning, as TRL loads; 16-bit for LoRA).
        lora_serving / optimizer (``"adamw"``, ``"adamw_8bit"``) / vllm (``"off"``, ``"colocate"``, ``"server"``) /
            gradient_checkpointing / precision (``"bf16"``, ``"fp16"``, ``"fp32"``; default: the card's):
            override ``args``.
        chunked_logits: TRL 1.16's fused LM head (True: what the trainer does) or full logits (for comparison).
        suggest: when it does not fit, look for the one change that would.

    Returns:
        a :class:`Plan`: ``rows``, ``totals`` per card, ``fits``, ``problems``, ``suggestion``.
    """
    options = dict(peft=peft, quantization=quantization, device=device, rollout=rollout, base_dtype=base_dtype,
                   lora_serving=lora_serving, optimizer=optimizer, vllm=vllm,
                   gradient_checkpointing=gradient_checkpointing, chunked_logits=chunked_logits, precision=precision,
                   prompt_length=prompt_length)
    spec = make_spec(model, args, **options)
    plan = plan_for(spec, capabilities)
    if not plan.fits and suggest:
        plan.suggestion = suggest_change(model, args, options, spec, capabilities)
    return plan
