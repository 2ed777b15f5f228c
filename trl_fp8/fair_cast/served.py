"""The served copy of a set of fp32 master parameters, and the bookkeeping around each optimizer step.

Pure PyTorch (no TRL). A :class:`ServedCopy` owns the fp32 master of every parameter it manages and writes the
served tensors (``served_dtype``) with one export rule: ``"rtn"``, ``"stochastic"`` or ``"error_feedback"``.
Between optimizer steps the parameters themselves hold the *served values* (exactly representable in fp32),
so the forward/backward that produce the loss run on exactly the weights the sampler serves; the gradient
w.r.t. the served value is applied to the master (straight-through)::

    copy.begin()           # master <- params; export; params <- served values
    ... forward/backward on the served values ...
    copy.before_step()     # params <- master  (the optimizer steps the master)
    optimizer.step()
    metrics = copy.after_step(step)   # master <- params; export; params <- served values
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .rounding import error_feedback_round, round_nearest, stochastic_round, ulp

EXPORT_MODES = ("rtn", "stochastic", "error_feedback")
METRIC_ELEMENTS = 65536  # elements sampled (fixed subset) for the metrics
LAG_EMA = 0.9  # EMA factor of the per-step master update used by `lag_steps`


class ServedCopy:
    """Master/served bookkeeping for ``named_params`` (fp32 parameters, e.g. ``model.named_parameters()``).

    ``served_tensors`` maps each name to the tensor the sampler reads (e.g. the parameters of a low-precision
    twin model); missing names get a fresh buffer.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        mode: str,
        served_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        served_tensors: dict[str, torch.Tensor] | None = None,
        metric_elements: int = METRIC_ELEMENTS,
    ):
        if mode not in EXPORT_MODES:
            raise ValueError(f"mode={mode!r} is not valid; allowed values: {', '.join(map(repr, EXPORT_MODES))}.")
        self.mode = mode
        self.dtype = served_dtype
        self.seed = int(seed)
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, p in named_params:
            if p.dtype != torch.float32:
                raise TypeError(
                    f"Fair Cast needs fp32 master weights, but parameter '{name}' is {p.dtype}. Load the model in "
                    "float32 (e.g. model_init_kwargs={'dtype': 'float32'})."
                )
            self.params[name] = p
        if not self.params:
            raise ValueError("Fair Cast: the model has no parameters to export.")
        served_tensors = served_tensors or {}
        self.master = {n: p.detach().clone() for n, p in self.params.items()}
        self.served = {}
        for n, p in self.params.items():
            t = served_tensors.get(n)
            if t is None:
                t = torch.empty(p.shape, dtype=served_dtype, device=p.device)
            elif t.shape != p.shape or t.dtype != served_dtype:
                raise ValueError(f"served tensor '{n}' is {t.dtype} {tuple(t.shape)}, expected {served_dtype} "
                                 f"{tuple(p.shape)}")
            self.served[n] = t
        self.residual = (
            {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.params.items()}
            if mode == "error_feedback" else {}
        )
        self.step = 0
        self._init_metric_subset(metric_elements)

    # -- export ---------------------------------------------------------------------------------------------
    def _export_one(self, index: int, name: str, step: int) -> None:
        src, dst = self.master[name], self.served[name]
        if self.mode == "rtn":
            round_nearest(src, self.dtype, out=dst)
        elif self.mode == "stochastic":
            stochastic_round(src, self.dtype, seed=self.seed, step=step, index=index, out=dst)
        else:
            error_feedback_round(src, self.residual[name], self.dtype, out=dst)

    @torch.no_grad()
    def export(self, step: int) -> None:
        """Write every served tensor from its master with this copy's rule (randomness keyed by ``step``)."""
        for index, name in enumerate(self.params):
            self._export_one(index, name, step)
        self.step = int(step)

    @torch.no_grad()
    def load_served_into_params(self) -> None:
        for n, p in self.params.items():
            p.data.copy_(self.served[n])  # exact: every served value is an fp32 value

    @torch.no_grad()
    def load_master_into_params(self) -> None:
        for n, p in self.params.items():
            p.data.copy_(self.master[n])

    @torch.no_grad()
    def capture_master(self) -> None:
        for n, p in self.params.items():
            self.master[n].copy_(p.data)

    # -- the optimizer-step cycle ----------------------------------------------------------------------------
    def begin(self, step: int = 0, restored: bool = False) -> None:
        """Start (or resume) training: take the master from the params unless restored from a checkpoint."""
        if not restored:
            self.capture_master()
            self.export(step)
        self.load_served_into_params()
        self._prev_master = self._sample(self.master)
        self._prev_served = self._sample(self.served)

    def before_step(self) -> None:
        self.load_master_into_params()

    def after_step(self, step: int) -> dict[str, float]:
        self.capture_master()
        self.export(step)
        self.load_served_into_params()
        return self.metrics()

    # -- metrics on a fixed random subset ------------------------------------------------------------------------
    def _init_metric_subset(self, budget: int) -> None:
        total = sum(p.numel() for p in self.params.values())
        gen = torch.Generator().manual_seed(self.seed ^ 0x5EED)
        self._subset = {}
        for n, p in self.params.items():
            k = max(1, min(p.numel(), math.ceil(budget * p.numel() / total)))
            self._subset[n] = torch.randperm(p.numel(), generator=gen)[:k].to(p.device)
        self._ema = None
        self._ema_steps = 0
        self._prev_master = self._prev_served = None

    def _sample(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1)[idx].float() for n, idx in self._subset.items()])

    @torch.no_grad()
    def metrics(self) -> dict[str, float]:
        """``visible_update_frac``, ``lag_steps`` and ``max_abs_err_ulps`` of the latest export (see README)."""
        w = self._sample(self.master)
        q = self._sample(self.served)
        out = {}
        if self._prev_served is not None:
            out["visible_update_frac"] = (q != self._prev_served).float().mean().item()
        if self._prev_master is not None:
            update = w - self._prev_master
            self._ema = update if self._ema is None else LAG_EMA * self._ema + (1 - LAG_EMA) * update
            self._ema_steps += 1
            direction = self._ema / (1 - LAG_EMA ** self._ema_steps) if self._ema_steps > 1 else self._ema
            norm2 = direction.double().pow(2).sum()
            if norm2 > 0:
                out["lag_steps"] = (torch.dot((w - q).double(), direction.double()) / norm2).item()
        finite = torch.isfinite(w)
        err = ((w - q).abs() / ulp(w, self.dtype))[finite]
        out["max_abs_err_ulps"] = err.max().item() if err.numel() else 0.0
        self._prev_master, self._prev_served = w, q
        return out

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "mode": self.mode,
            "served_dtype": str(self.dtype).replace("torch.", ""),
            "seed": self.seed,
            "step": self.step,
            "master": {n: t.detach().cpu().clone() for n, t in self.master.items()},
            "served": {n: t.detach().cpu().clone() for n, t in self.served.items()},
            "residual": {n: t.detach().cpu().clone() for n, t in self.residual.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("mode", self.mode), ("served_dtype", str(self.dtype).replace("torch.", ""))):
            if state.get(key) != mine:
                raise ValueError(f"Fair Cast checkpoint has {key}={state.get(key)!r}, but this run uses {mine!r}.")
        missing = set(self.master) - set(state["master"])
        if missing:
            raise ValueError(f"Fair Cast checkpoint lacks the master of: {', '.join(sorted(missing))}")
        for n in self.master:
            self.master[n].copy_(state["master"][n])
            self.served[n].copy_(state["served"][n])
            if self.residual:
                self.residual[n].copy_(state["residual"][n])
        self.seed = int(state["seed"])
        self.step = int(state["step"])
