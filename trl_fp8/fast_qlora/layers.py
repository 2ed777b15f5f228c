"""What fast QLoRA changes in the policy at start, and undoes at the end of training:

- **kept layers**: the 4-bit base of the chosen LoRA layers is swapped for a :class:`~trl_fp8.fourbit.DenseBase`
  with the same dequantized values (the same function, bit for bit on CPU), so they never dequantize again;
- **speed mode** (``qlora_adapter_layers=k``): the adapters of the blocks below the top ``k`` are frozen and, while
  their delta is exactly zero (a fresh adapter), skipped; the output of the highest frozen block is cut from the
  graph, so backward stops where no block trains.

Every change is recorded and undone by :meth:`PolicyEdits.undo` (the 4-bit modules are kept aside while the dense
copies serve), so after training the policy is the user's QLoRA model again — adapter files complete, 4-bit bases in
place. The dense copies are kept for a later ``train()`` (which re-applies the same modules: a capability holding
one, e.g. Fair Cast's served unit, stays valid); they go with the trainer.
"""

from __future__ import annotations

import math

import torch

from .. import fourbit
from .ranking import LayerCost, estimate_error, relative_error, select_within_budget


@torch.no_grad()
def rank_layers(layers) -> list[LayerCost]:
    """Data-free NF4 error estimate of each LoRA-over-4-bit layer's base, with the bytes of its dense copy."""
    out = []
    for name, layer in layers:
        base = layer.get_base_layer()
        state = base.weight.quant_state
        err2, norm2 = estimate_error(fourbit.codes(base).cpu(), fourbit.block_absmax(state).cpu(),
                                     fourbit.code_table(base), state.blocksize)
        size = torch.empty((), dtype=state.dtype).element_size()
        bias = base.bias.numel() if base.bias is not None else 0
        out.append(LayerCost(name, relative_error(err2, norm2), (math.prod(state.shape) + bias) * size))
    return out


def find_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """The model's stack of transformer blocks: the longest ``ModuleList`` whose items hold LoRA layers."""
    from peft.tuners.lora import LoraLayer

    best = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            if all(any(isinstance(m, LoraLayer) for m in block.modules()) for block in module):
                if best is None or len(module) > len(best[1]):
                    best = (name, module)
    return best


def _skip_lora(layer):
    base = layer.get_base_layer()
    return lambda x, *args, **kwargs: base(x, *args, **kwargs)


def _cut(module, inputs, output):
    """Forward hook: the block's hidden states leave the graph (backward stops here), as a leaf that still
    requires grad (so checkpointed blocks above it keep computing their parameters' gradients)."""
    if not torch.is_grad_enabled():
        return output
    if isinstance(output, torch.Tensor):
        return output.detach().requires_grad_(output.requires_grad)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        first = output[0]
        return (first.detach().requires_grad_(first.requires_grad),) + tuple(output[1:])
    return output


class PolicyEdits:
    """The edits fast QLoRA makes to a PEFT policy, recorded so they can be undone."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.kept: list[tuple[object, torch.nn.Module]] = []  # (LoRA layer, its 4-bit base kept aside)
        self._dense: dict[str, torch.nn.Module] = {}  # the dense copies, by layer name, reused when re-applied
        self.kept_bytes = 0
        self.frozen: list[tuple[torch.nn.Parameter, bool]] = []
        self.skipped: list[object] = []
        self.hook = None
        self.trained_blocks: tuple[int, int] | None = None  # (first trained block, number of blocks)

    # -- kept layers ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def keep_dense(self, layers: dict, chosen: list[LayerCost]) -> None:
        for cost in chosen:
            layer = layers[cost.name]
            base = layer.base_layer
            if not fourbit.is_4bit(base):
                continue
            dense = self._dense.get(cost.name)  # a second train(): the same dense modules (others may hold them)
            if dense is None:
                dense = self._dense[cost.name] = fourbit.DenseBase.from_4bit(base, cost.name)
            layer.base_layer = dense
            self.kept.append((layer, base))
            self.kept_bytes += cost.dense_bytes

    # -- speed mode ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def train_top_blocks(self, k: int) -> None:
        from peft.tuners.lora import LoraLayer

        found = find_blocks(self.model)
        if found is None:
            raise ValueError("qlora_adapter_layers: the policy has no stack of transformer blocks holding LoRA layers "
                             "(a ModuleList such as model.layers); use qlora_adapter_layers='all'.")
        _, blocks = found
        n = len(blocks)
        if k >= n:
            self.trained_blocks = (0, n)
            return
        first = n - k
        for block in list(blocks)[:first]:
            for module in block.modules():
                if not isinstance(module, LoraLayer):
                    continue
                zero = True
                for name, param in module.named_parameters():
                    if "lora_" in name:
                        self.frozen.append((param, param.requires_grad))
                        param.requires_grad_(False)
                        if "lora_B" in name and bool(param.ne(0).any()):
                            zero = False
                if zero and "forward" not in vars(module):  # a zero delta: the base alone computes the same
                    module.forward = _skip_lora(module)
                    self.skipped.append(module)
        self.hook = blocks[first - 1].register_forward_hook(_cut)
        self.trained_blocks = (first, n)

    # -- undo ----------------------------------------------------------------------------------------------------
    def undo(self) -> None:
        for layer, base in reversed(self.kept):
            layer.base_layer = base
        self.kept, self.kept_bytes = [], 0
        for param, requires_grad in self.frozen:
            param.requires_grad_(requires_grad)
        self.frozen = []
        for module in self.skipped:
            vars(module).pop("forward", None)
        self.skipped = []
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        self.trained_blocks = None


__all__ = ["PolicyEdits", "find_blocks", "rank_layers", "select_within_budget"]
