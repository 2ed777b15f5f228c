"""What a memory plan is made for: the model, the run's settings, the rollout shape and the device, as plain data.

:class:`PlanSpec` is what each capability's ``memory_rows(spec)`` reads: the architecture (:class:`~.models.Arch`),
the run's ``GRPOConfig`` fields (``spec.args``, read with ``getattr`` so a real config or a namespace both work),
LoRA (:class:`LoraSpec`) and 4-bit quantization (:class:`QuantSpec`), element sizes, the rollout shape and the
device. Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..memory import FP32, HALF  # noqa: F401  (re-exported: the plan's modules import them from here)
from .devices import Device
from .models import ATTENTION, LINEAR_NAMES, Arch, Tensor


@dataclass(frozen=True)
class QuantSpec:
    """bitsandbytes 4-bit weights (``BitsAndBytesConfig(load_in_4bit=True, ...)``), counted as bitsandbytes 0.50
    stores them (``bitsandbytes.functional.quantize_4bit``): per quantized weight of ``n`` elements

    - packed codes: ``(n + 1) // 2`` bytes (two 4-bit codes per ``uint8``, ``quant_storage=torch.uint8``);
    - one absmax per ``blocksize`` block: ``blocks = ceil(n / blocksize)``, fp32 (4 B each) — or, with double
      quantization (``compress_statistics`` / ``bnb_4bit_use_double_quant``), each absmax as a ``uint8`` (1 B) plus
      ``quantize_blockwise(absmax - offset, blocksize=256)``'s state: one fp32 nested absmax per 256 blocks, its
      256-entry fp32 code (1024 B, copied per weight) and the fp32 ``offset`` (4 B);
    - the 16-entry fp32 NF4/FP4 code table (64 B, one per weight).
    """

    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = 64

    def weight_bytes(self, numel: int) -> int:
        blocks = -(-numel // self.blocksize)
        packed = (numel + 1) // 2
        code = 16 * FP32
        if self.double_quant:
            nested = -(-blocks // 256)
            return packed + blocks + FP32 * nested + 256 * FP32 + FP32 + code
        return packed + FP32 * blocks + code

    def engine_weight_bytes(self, numel: int) -> int:
        """The same weight as a vLLM engine holds it: vLLM's bitsandbytes loader unpacks double quantization, so
        every absmax is fp32 (4 B a block) whatever ``double_quant`` says."""
        return (numel + 1) // 2 + FP32 * -(-numel // self.blocksize) + 16 * FP32

    @property
    def label(self) -> str:
        return f"{self.quant_type.upper()}{' + double quant' if self.double_quant else ''}, blocks of {self.blocksize}"


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of rank ``r`` on the given projections of every block (PEFT ``LoraConfig``; ``"all-linear"`` =
    every block linear: the seven projections, Phi-3's four fused ones)."""

    r: int = 16
    targets: tuple[str, ...] = LINEAR_NAMES
    dropout: float = 0.0  # lora_dropout: above 0, each LoRA layer saves a dropout mask and its own lora_A input

    def tensors(self, arch: Arch) -> list[Tensor]:
        """The factors PEFT creates: ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` per targeted projection."""
        out = []
        for i in range(arch.layers):
            for p in arch.projections:
                if p not in self.targets:
                    continue
                o, n = arch.linear_shape(p)
                group = "self_attn" if p in ATTENTION + ("qkv_proj",) else "mlp"
                name = f"base_model.model.model.layers.{i}.{group}.{p}"
                out.append(Tensor(f"{name}.lora_A.default.weight", self.r * n, "lora_A", p, (self.r, n)))
                out.append(Tensor(f"{name}.lora_B.default.weight", o * self.r, "lora_B", p, (o, self.r)))
        return out

    def params(self, arch: Arch) -> int:
        return sum(t.numel for t in self.tensors(arch))


@dataclass(frozen=True)
class Rollout:
    """The rollout shape: ``generation_batch`` rows generated at once (``per_device_train_batch_size ×
    steps_per_generation``), ``micro_batch`` rows per loss forward (``per_device_train_batch_size``), each of at most
    ``prompt_length + completion_length`` tokens (``max_completion_length``; prompts are padded to the longest)."""

    prompt_length: int = 256
    completion_length: int = 512
    micro_batch: int = 8
    generation_batch: int = 8

    @property
    def seq(self) -> int:
        return self.prompt_length + self.completion_length

    def check(self) -> None:
        for name in ("prompt_length", "completion_length", "micro_batch", "generation_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout {name} must be an integer >= 1, got {value!r}.")


@dataclass(frozen=True)
class PlanSpec:
    """Everything the rows are computed from (see the module docstring).

    ``base_bytes``: element size of the weights as loaded (the non-quantized ones, with ``quant``);
    ``compute_bytes``: the autocast dtype's (4: fp32 training, no autocast); ``adapter_bytes``: the LoRA factors' as
    trained; ``vllm``: ``"off"``, ``"colocate"`` or ``"server"``; ``lora_serving``: ``"adapters"`` or ``"merged"``;
    ``optimizer``: ``"adamw"`` (fp32 moments) or ``"adamw_8bit"`` (bitsandbytes blockwise 8-bit); ``decision``: the
    run's :class:`trl_fp8.sampling.SamplingDecision`, the one the trainer makes for the same config and model (its
    kind's handler, :mod:`trl_fp8.kinds`, gives the sampler's bytes)."""

    arch: Arch
    args: object
    device: Device
    rollout: Rollout
    lora: LoraSpec | None = None
    quant: QuantSpec | None = None
    base_bytes: int = FP32
    compute_bytes: int = HALF
    adapter_bytes: int = FP32
    vllm: str = "off"
    lora_serving: str = "adapters"
    gradient_checkpointing: bool = True
    chunked_logits: bool = True
    optimizer: str = "adamw"
    extra: dict = field(default_factory=dict)
    decision: object = None

    # -- parameters ----------------------------------------------------------------------------------------------
    @property
    def full(self) -> bool:
        """Full fine-tuning: every parameter trains."""
        return self.lora is None

    def base_tensors(self) -> list[Tensor]:
        return self.arch.tensors()

    def adapter_tensors(self) -> list[Tensor]:
        return [] if self.lora is None else self.lora.tensors(self.arch)

    def trainable_tensors(self) -> list[Tensor]:
        return self.base_tensors() if self.full else self.adapter_tensors()

    @property
    def base_params(self) -> int:
        return self.arch.params

    @property
    def adapter_params(self) -> int:
        return 0 if self.lora is None else self.lora.params(self.arch)

    @property
    def trainable_params(self) -> int:
        return self.base_params if self.full else self.adapter_params

    @property
    def trainable_bytes(self) -> int:
        """Element size of the trainable parameters (their gradients and AdamW moments share it)."""
        return self.base_bytes if self.full else self.adapter_bytes

    def quantized(self, t: Tensor) -> bool:
        return self.quant is not None and t.role == "linear"

    def base_weight_bytes(self) -> int:
        """The base model's parameters as loaded: 4-bit linears as bitsandbytes stores them, the rest dense."""
        return sum(self.quant.weight_bytes(t.numel) if self.quantized(t) else self.base_bytes * t.numel
                   for t in self.base_tensors())

    def largest_linear(self) -> int:
        return max(t.numel for t in self.base_tensors() if t.role == "linear")

    # -- run settings --------------------------------------------------------------------------------------------
    def arg(self, name: str, default=None):
        return getattr(self.args, name, default)

    @property
    def use_vllm(self) -> bool:
        return self.vllm != "off"

    @property
    def completion_tokens(self) -> int:
        """Completion tokens of one micro-batch (every row at the full length: the worst case)."""
        return self.rollout.micro_batch * self.rollout.completion_length

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch's loss forward (prompt + completion, padded)."""
        return self.rollout.micro_batch * self.rollout.seq

