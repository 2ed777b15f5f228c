"""Counting dequantizations: every pass over a 4-bit weight (a forward, a backward through it, a cache build).

Forward hooks on the 4-bit modules count forwards; a hook on each forward's output counts the backward that
dequantizes the weight again (bitsandbytes' ``MatMul4Bit.backward``); cache builds report their own. Hooks only:
nothing of bitsandbytes is patched.
"""

from __future__ import annotations

import torch

from .. import fourbit


class DequantCounter:
    def __init__(self):
        self.forward = 0
        self.backward = 0
        self.explicit = 0  # cache builds and other whole-weight dequantizations
        self._handles = []

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.explicit

    def count_explicit(self) -> None:
        self.explicit += 1

    def reset(self) -> dict[str, int]:
        out = {"forward": self.forward, "backward": self.backward, "explicit": self.explicit, "total": self.total}
        self.forward = self.backward = self.explicit = 0
        return out

    def _on_backward(self, grad):
        self.backward += 1

    def _on_forward(self, module, inputs, output):
        self.forward += 1
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_backward)

    def attach(self, model: torch.nn.Module) -> int:
        """Count every 4-bit linear of ``model``; returns how many are watched."""
        n = 0
        for module in model.modules():
            if fourbit.is_4bit(module):
                self._handles.append(module.register_forward_hook(self._on_forward))
                n += 1
        return n

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
