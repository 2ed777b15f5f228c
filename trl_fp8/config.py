"""``trl_fp8.GRPOConfig``: TRL's ``GRPOConfig`` plus the trl_fp8 fields.

Every trl_fp8 field is a dataclass field with ``metadata={"help": ...}``, so ``TrlParser``, YAML recipes and
the ``trl-fp8`` CLI see it like any TRL field. With every trl_fp8 field at its default the trainer behaves
exactly like ``trl.GRPOTrainer``. Invalid values raise ``ValueError`` in ``__post_init__`` (config time),
naming the field and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from trl import GRPOConfig as _TRLGRPOConfig

from .capabilities import CAPABILITIES
from .components import check_choice  # noqa: F401  (re-exported: part of trl_fp8.config's API)
from .precision import PrecisionArgs, resolve_precision


@dataclass
class ReportingArgs:
    metrics_jsonl: str | None = field(
        default=None,
        metadata={
            "help": "trl_fp8: path of a JSON-lines file that receives every logged metrics record (one JSON object "
            "per line, with `step` and `epoch`), written by the main process. None (default) writes nothing."
        },
    )


_MIXINS = (ReportingArgs, PrecisionArgs) + tuple(c.Args for c in CAPABILITIES if c.Args is not None)
# Names of the fields trl_fp8 adds on top of trl.GRPOConfig (every field of the capabilities' mixins).
TRL_FP8_FIELDS: tuple[str, ...] = tuple(f.name for mixin in _MIXINS for f in fields(mixin))


@dataclass
class GRPOConfig(*_MIXINS, _TRLGRPOConfig):
    r"""
    Configuration for [`trl_fp8.GRPOTrainer`]: every parameter of [`trl.GRPOConfig`] plus the ones below.

    Parameters:
        > trl_fp8: reporting

        metrics_jsonl (`str`, *optional*):
            Path of a JSON-lines file to which every logged metrics record is appended (one JSON object per
            line, with `step` and `epoch`), on the main process only. `None` (default) writes nothing.

        > trl_fp8: precision

        precision (`str`, *optional*):
            `"auto"`: bf16 on GPUs with native bf16 (compute capability >= 8.0), fp16 autocast over fp32 master
            weights on older GPUs (T4, V100) — with a colocated vLLM engine started in `dtype="half"` and Fair Cast's
            `served_dtype="float16"` — and fp32 on CPU; decided from the compute capability, not from
            `torch.cuda.is_bf16_supported()` (True on a T4 through emulation). Or `"bf16"`, `"fp16"`, `"fp32"`.
            Sets `bf16`/`fp16`; giving either explicitly with a contradicting value is an error. `None` (default):
            `bf16`/`fp16` as given (TRL's behaviour).

        > trl_fp8: Fair Cast

        fair_cast (`str`, *optional*, defaults to `"off"`):
            How the fp32 master weights are exported into the served low-precision copy that generates
            rollouts: `"off"` (TRL's behaviour), `"rtn"` (round-to-nearest, the explicit baseline with the same
            served-copy machinery), `"stochastic"` (unbiased stochastic rounding) or `"error_feedback"`
            (deterministic, with an fp32 residual). When on, the loss is computed on the served copy and the
            gradient is applied to the fp32 master.
        served_dtype (`str`, *optional*, defaults to `"bfloat16"`):
            Dtype of the served copy: `"bfloat16"` or `"float16"` (GPUs without bf16, e.g. T4).
        fair_cast_seed (`int`, *optional*):
            Seed of the stochastic-rounding streams; defaults to one derived from `seed`.

        > trl_fp8: DUET token budget

        duet (`bool`, *optional*, defaults to `False`):
            Spend a per-step token budget: a surrogate of each prompt's informativeness sets how many of the
            `num_generations` slots get a real rollout, and a marker-gated rule stops rollouts early; importance
            weights keep the gradient unbiased.
        duet_budget (`float`, *optional*, defaults to `0.5`):
            Fraction β in (0, 1] of the full GRPO budget (prompts × num_generations × mean rollout length).
        duet_n_min (`int`, *optional*, defaults to `2`) / duet_n_max (`int`, *optional*):
            A prompt gets 0 rollouts or a group of `duet_n_min`..`duet_n_max` (a lone rollout's group-relative
            advantage is 0, so `duet_n_min` must be >= 2); a prompt whose share of the budget is below `duet_n_min`
            is sampled with that probability and weighted by its inverse. `duet_n_max` defaults to (and may not
            exceed) `num_generations`.
        duet_markers (`list[str]`, *optional*, defaults to `["math"]`):
            Answer markers: preset names (`math`, `code`, `qa`) and/or regular expressions.
        duet_abort_keep_prob (`float`, *optional*, defaults to `0.05`):
            Probability that a marker-less rollout is kept (and weighted 1/p) instead of aborted; also the
            probability that a rollout skips the confidence trim.
        duet_min_propensity (`float`, *optional*, defaults to `0.05`) / duet_max_weight (`float`, defaults to `1000`):
            Floor of the allocation propensity and cap of the importance weight.
        duet_abort_grace (`int`, *optional*):
            Tokens past K2 (the 80th percentile of recent kept lengths) before a marker-less rollout is aborted;
            default: the reference's 150 tokens at a 3072-token cap, scaled to `max_completion_length` (>= 8).

        > trl_fp8: weight-sync checks

        sync_checks (`str` or `list[str]`, *optional*, defaults to `"default"`):
            Which of the seven sampler/learner weight-sync checks run: `"default"` (all but the differential
            oracle; cheap enough for production), `"all"`, `"off"`, or a list of names among `recipe_parity`,
            `coverage`, `freshness`, `quant_parity`, `logprob_agreement`, `differential_oracle`, `cache_hygiene`.
            They run whenever the sampler is separate from the learner (Fair Cast's twin, vLLM); TRL's default
            in-process sampler *is* the learner, so there is nothing to check and nothing runs.
        sync_check_interval (`int`, *optional*, defaults to `1`):
            Run the per-sync checks every N syncs and the logprob check every N generations.
        sync_check_action (`str`, *optional*, defaults to `"raise"`):
            On a failed check: `"raise"` a `trl_fp8.WeightSyncError`, or `"warn"` (a `WeightSyncWarning`; the
            metric `sync/<check>` drops to 0) and keep training.

        > trl_fp8: MXFP8

        mxfp8 (`bool`, *optional*, defaults to `False`):
            Train the linear layers in MXFP8 through torchao (e4m3 elements, one E8M0 scale per 32-element block,
            RCEIL scale rounding); with Fair Cast the in-process sampler computes with the identical quantizer.
        mxfp8_kernel (`str`, *optional*, defaults to `"auto"`):
            `"auto"`: real kernels on Blackwell (SM100), else torchao's emulated MXFP8 (exact numerics, slower than
            bf16; one log line); `"emulated"`; `"sm100"`: demand the real kernels and fail elsewhere.
        mxfp8_exclude (`list[str]`, *optional*):
            Regular expressions (searched in module names) of linear layers kept in high precision on both sides.
            Default: the output head, embeddings and MoE router gates (`lm_head`, `embed`, a module named `gate` or
            `router` — not `gate_proj`).

        > trl_fp8: fast QLoRA

        fast_qlora (`str`, *optional*, defaults to `"off"`):
            For a policy loaded with `BitsAndBytesConfig(load_in_4bit=True)` and trained with LoRA adapters: `"off"`
            (TRL's QLoRA), `"auto"` (on when the policy has LoRA layers over 4-bit bases) or `"on"` (refuse to start
            without them). Keeps the highest-error 4-bit layers dense, decodes rollouts through a dense
            `dequant(W) + ΔW` cache, and sends a vLLM engine 16-bit merged weights instead of TRL's 4-bit merge.
        qlora_keep_budget_gb (`float`, *optional*, defaults to `0.25`):
            GiB of dense copies (in the layers' compute dtype) of the 4-bit layers with the highest estimated NF4
            error per byte; those never dequantize again. `0` keeps none.
        qlora_rollout_cache_gb (`float`, *optional*):
            GiB of dense weights kept for one in-process generation call; `0` disables the cache. Default: the free
            memory minus max(2 GiB, 25%), at most 8 GiB.
        qlora_cache_dtype (`str`, *optional*, defaults to `"auto"`):
            Dtype of the rollout cache: `"auto"` (GPU: the layers' compute dtype; CPU: bfloat16 where the CPU
            computes it natively, else the compute dtype), `"float32"`, `"bfloat16"` or `"float16"`.
        qlora_adapter_layers (`str`, *optional*, defaults to `"all"`):
            `"all"`, or k: only the adapters of the top k transformer blocks train (the blocks below are frozen and
            backward stops above them).

        > trl_fp8: time budget

        time_budget (`str` or `float`, *optional*):
            Wall-clock budget: seconds, or `"11h30m"`, `"90m"`, `"45s"`, `"1h"`, `"1d2h"`, `"11:30:00"`. Before it
            runs out (with the expected time of the next step and of a save, measured), a complete checkpoint is
            saved — even with `save_strategy="no"` — and training stops cleanly; a SIGTERM takes the same path at
            the end of the step in flight. Counted from the start of the process (a notebook's kernel). When unset,
            read from the environment variable `TRL_FP8_TIME_BUDGET`; `None`/`"off"`: no budget. The time used is
            stored in each checkpoint and accumulates across resumes (`budget/elapsed_s`).
        time_budget_margin (`str` or `float`, *optional*):
            Time kept free after the final checkpoint is written (same forms). Default: 5% of the budget, at most
            1 minute.
        time_budget_scope (`str`, *optional*, defaults to `"session"`):
            `"session"`: the budget limits this process (one Colab/Kaggle session; each resumed session gets it
            anew); `"total"`: the run's time summed over every session.
    """

    def __post_init__(self):
        resolve_precision(self)  # sets bf16/fp16 before TRL (unset bf16 -> True) and transformers read them
        super().__post_init__()
        self._validate_metrics_jsonl()
        for capability in CAPABILITIES:
            capability.validate(self)
        self._admit_engine()

    def _admit_engine(self) -> None:
        """Refuse, at config time, a capability asked for under an engine it does not support: DeepSpeed/FSDP from
        ``args`` *or* from an accelerate config (the environment ``accelerate launch`` sets); checked again at
        trainer start (:func:`trl_fp8.distributed.admit`). A capability on by default is left to the trainer."""
        from .distributed import admit, detect_config

        engine = detect_config(self)
        for capability in CAPABILITIES:
            soft = capability.soft_default is not None and capability.soft_default(self)
            if capability.wanted(self) and not soft:
                admit(capability, self, engine)

    def _validate_metrics_jsonl(self) -> None:
        if self.metrics_jsonl is None:
            return
        if not isinstance(self.metrics_jsonl, (str, os.PathLike)) or not str(self.metrics_jsonl).strip():
            raise ValueError(f"metrics_jsonl must be a non-empty file path or None, got {self.metrics_jsonl!r}.")
        self.metrics_jsonl = os.fspath(self.metrics_jsonl)
        if os.path.isdir(self.metrics_jsonl):
            raise ValueError(
                f"metrics_jsonl={self.metrics_jsonl!r} is a directory; give a file path such as "
                f"'{os.path.join(self.metrics_jsonl, 'metrics.jsonl')}'."
            )

    def trl_fp8_fields(self) -> dict:
        """The trl_fp8-specific fields and their values (handy for logging a run's recipe)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in TRL_FP8_FIELDS}

