"""The served copy of a set of fp32 master parameters, and the bookkeeping around each optimizer step.

Pure PyTorch (no TRL). A :class:`ServedCopy` owns the fp32 master of every parameter it manages and writes the
served tensors (``served_dtype``) with one export rule: ``"rtn"``, ``"stochastic"`` or ``"error_feedback"`` (and
``"rtn_noise"``, the experimental equal-noise control: round-to-nearest plus stochastic rounding's noise).
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

from ..numerics import dtype_name
from ..serving import folded
from .memory import METRIC_ELEMENTS, metric_subset_sizes
from .rounding import error_feedback_round, round_nearest, rtn_plus_noise, stochastic_round, ulp
from .declaration import EXPORT_MODES

LAG_EMA = 0.9  # EMA factor of the per-step master update used by `lag_steps`


class ParamUnit:
    """A served tensor that is one fp32 parameter of the learner (the usual case).

    The unit keeps the parameter's fp32 master; between optimizer steps the parameter holds the served value.
    """

    def __init__(self, name: str, param: torch.nn.Parameter):
        if param.dtype != torch.float32:
            raise TypeError(
                f"Fair Cast needs fp32 master weights, but parameter '{name}' is {param.dtype}. Load the model in "
                "float32 (e.g. model_init_kwargs={'dtype': 'float32'})."
            )
        self.name = name
        self.param = param
        self.trainable = param.requires_grad
        self.master = param.detach().clone()

    @property
    def shape(self):
        return self.param.shape

    @property
    def device(self):
        return self.param.device

    def capture(self) -> None:  # after the optimizer step: the parameter holds the new master
        self.master.copy_(self.param.data)

    def restore(self) -> None:  # before the optimizer step: the optimizer must step the master
        self.param.data.copy_(self.master)

    def apply(self, served: torch.Tensor) -> None:  # the learner computes on exactly the served value
        self.param.data.copy_(served)


class AdapterUnit(ParamUnit):
    """One LoRA factor of an adapter-served LoRA model (``lora_serving="adapters"``): the base is served as loaded
    and only the factors are exported.

    The served tensor of a ``lora_B`` factor is ``export(s·B)``, with ``s`` the layer's LoRA scaling folded in where the
    rounding happens: an engine given it applies scale 1 and rounds nothing again (vLLM would otherwise multiply B by
    ``s`` in 16-bit after the push). Between optimizer steps the parameter holds ``served / s``: exact when ``s`` is a
    power of two (the usual ``lora_alpha / r``); otherwise within fp32 rounding of it. ``lora_A`` factors (and ``s =
    1``) are served as they are. The fp32 master is ``stored`` (unscaled); ``master`` is what is exported (scaled).
    """

    def __init__(self, name: str, param: torch.nn.Parameter, scale: float = 1.0):
        if param.dtype != torch.float32:
            raise TypeError(f"Fair Cast needs an fp32 master of LoRA factor '{name}', got {param.dtype}.")
        self.name = name
        self.param = param
        self.trainable = param.requires_grad
        self.stored = param.detach().clone()
        self.scale = float(scale)
        if not math.isfinite(self.scale) or self.scale == 0:
            raise ValueError(f"LoRA factor '{name}': scaling {scale!r} cannot be folded into the served factor.")

    @property
    def master(self) -> torch.Tensor:
        return self.stored if self.scale == 1 else folded(self.stored, self.scale)

    def capture(self) -> None:
        self.stored.copy_(self.param.data)

    def restore(self) -> None:
        self.param.data.copy_(self.stored)

    def apply(self, served: torch.Tensor) -> None:
        if self.scale == 1:
            self.param.data.copy_(served)
        else:
            torch.div(served.float(), self.scale, out=self.param.data)


class ServedCopy:
    """Master/served bookkeeping for a list of units (see :class:`ParamUnit`; LoRA layers have their own).

    A unit has ``name``, ``shape``, ``device``, ``trainable``, ``master`` (the fp32 value to export) and
    ``capture()`` / ``restore()`` / ``apply(served)``. Each unit gets a served buffer of its shape in
    ``served_dtype`` (what a sync streams to the sampler). Frozen units are exported once, at :meth:`begin`: their master never changes.
    """

    def __init__(
        self,
        units,
        mode: str,
        served_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        metric_elements: int = METRIC_ELEMENTS,
    ):
        if mode not in EXPORT_MODES:
            raise ValueError(f"mode={mode!r} is not valid; allowed values: {', '.join(map(repr, EXPORT_MODES))}.")
        self.mode = mode
        self.dtype = served_dtype
        self.seed = int(seed)
        self.units = {u.name: u for u in units}
        if not self.units:
            raise ValueError("Fair Cast: the model has no parameters to export.")
        self.served = {n: torch.empty(u.shape, dtype=served_dtype, device=u.device) for n, u in self.units.items()}
        self.residual = (
            {n: torch.zeros(u.shape, dtype=torch.float32, device=u.device) for n, u in self.units.items()}
            if mode == "error_feedback" else {}
        )
        self._index = {n: i for i, n in enumerate(self.units)}
        self.trainable = [n for n, u in self.units.items() if u.trainable] or list(self.units)
        self.step = 0
        self._init_metric_subset(metric_elements)

    @classmethod
    def from_named_params(cls, named_params: Iterable[tuple[str, torch.nn.Parameter]], mode: str, *args, **kwargs):
        """A served copy of plain fp32 parameters, e.g. ``model.named_parameters()``."""
        return cls([ParamUnit(n, p) for n, p in named_params], mode, *args, **kwargs)

    @property
    def master(self) -> dict[str, torch.Tensor]:
        return {n: u.master for n, u in self.units.items()}

    # -- export ---------------------------------------------------------------------------------------------
    def _export_one(self, name: str, step: int) -> None:
        unit = self.units[name]
        src, dst = unit.master, self.served[name]
        index = getattr(unit, "index", self._index[name])  # a shard: its tensor's one-process index ...
        if self.mode == "rtn":
            round_nearest(src, self.dtype, out=dst)
        elif self.mode == "stochastic":  # ... and the global index of its first element (see fair_cast.sharded)
            stochastic_round(src, self.dtype, seed=self.seed, step=step, index=index, out=dst,
                             offset=getattr(unit, "offset", 0))
        elif self.mode == "rtn_noise":  # the control: keyed and sharded as SR is
            rtn_plus_noise(src, self.dtype, seed=self.seed, step=step, index=index, out=dst,
                           offset=getattr(unit, "offset", 0))
        else:
            error_feedback_round(src, self.residual[name], self.dtype, out=dst)

    @torch.no_grad()
    def export(self, step: int, names=None) -> None:
        """Write served tensors from their masters with this copy's rule (randomness keyed by ``step``)."""
        for name in self.units if names is None else names:
            self._export_one(name, step)
        self.step = int(step)

    @torch.no_grad()
    def _apply(self, names) -> None:
        for n in names:
            self.units[n].apply(self.served[n])  # exact: every served value is an fp32 value

    # -- the optimizer-step cycle ----------------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, step: int = 0, restored: bool = False) -> None:
        """Start (or resume) training: export everything unless restored from a checkpoint."""
        if not restored:
            for u in self.units.values():
                u.capture()
            self.export(step)
        self._apply(self.units)
        self._prev_master = self._sample({n: self.units[n].master for n in self._subset})
        self._prev_served = self._sample(self.served)

    @torch.no_grad()
    def before_step(self) -> None:
        for n in self.trainable:
            self.units[n].restore()

    @torch.no_grad()
    def after_step(self, step: int) -> dict[str, float]:
        for n in self.trainable:
            self.units[n].capture()
        self.export(step, self.trainable)
        self._apply(self.trainable)
        return self.metrics()

    # -- metrics on a fixed random subset ------------------------------------------------------------------------
    def _init_metric_subset(self, budget: int) -> None:
        # metrics follow the units that change (the trainable ones)
        sizes = {n: math.prod(self.units[n].shape) for n in self.trainable}
        gen = torch.Generator().manual_seed(self.seed ^ 0x5EED)
        self._subset = {}
        for (n, numel), k in zip(sizes.items(), metric_subset_sizes(list(sizes.values()), budget)):
            # clone: a slice would keep the whole int64 permutation (8 B per element) alive on CPU
            self._subset[n] = torch.randperm(numel, generator=gen)[:k].clone().to(self.units[n].device)
        self._ema = None
        self._ema_steps = 0
        self._prev_master = self._prev_served = None

    def _sample(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1)[idx].float() for n, idx in self._subset.items()])

    @torch.no_grad()
    def metrics(self) -> dict[str, float]:
        """``visible_update_frac``, ``lag_steps`` and ``max_abs_err_ulps`` of the latest export (see README)."""
        w = self._sample({n: self.units[n].master for n in self._subset})  # derived masters: only those sampled
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
            "served_dtype": dtype_name(self.dtype),
            "seed": self.seed,
            "step": self.step,
            "master": {n: getattr(u, "stored", u.master).detach().cpu().clone() for n, u in self.units.items()
                       if isinstance(u, ParamUnit)},
            "served": {n: t.detach().cpu().clone() for n, t in self.served.items()},
            "residual": {n: t.detach().cpu().clone() for n, t in self.residual.items()},
            # the lag metric's running direction: without it the first lag_steps after a resume would differ
            "metrics": {"ema": None if self._ema is None else self._ema.detach().cpu().clone(),
                        "ema_steps": self._ema_steps},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("mode", self.mode), ("served_dtype", dtype_name(self.dtype))):
            if state.get(key) != mine:
                raise ValueError(f"Fair Cast checkpoint has {key}={state.get(key)!r}, but this run uses {mine!r}.")
        masters = [n for n, u in self.units.items() if isinstance(u, ParamUnit)]
        missing = (set(masters) - set(state["master"])) | (set(self.units) - set(state["served"]))
        if missing:
            raise ValueError(f"Fair Cast checkpoint lacks the state of: {', '.join(sorted(missing))}")
        for n in self.units:
            if n in masters:
                getattr(self.units[n], "stored", self.units[n].master).copy_(state["master"][n])
            self.served[n].copy_(state["served"][n])
            if self.residual:
                self.residual[n].copy_(state["residual"][n])
        self.seed = int(state["seed"])
        self.step = int(state["step"])
        metrics = state.get("metrics")  # absent from checkpoints written before it was saved
        if metrics is not None:
            ema = metrics["ema"]
            self._ema = None if ema is None else ema.to(next(iter(self._subset.values())).device)
            self._ema_steps = int(metrics["ema_steps"])
