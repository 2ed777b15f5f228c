"""The end of the last complete optimizer step: what a stop inside the next step saves.

A capability may stop the step in flight (:class:`~trl_fp8.capability.StopNow`, e.g. the time budget on SIGTERM) after
that step's generation has already moved state: the RNG streams (sampling), DUET's controller (its planning draws),
the checks' counters (the step's sync). The weights, optimizer and scheduler are still the last complete step's (the
cut step never reached its optimizer step), so the checkpoint the stop writes must hold the rest as it was then too —
else a resumed run differs from the uninterrupted one, and state counts the cut step twice. :func:`mark` records it at
the first micro-batch of every optimizer step (the trainer's ``training_step``), before anything of that step ran:
TRL's generation step counter and buffer always (references, no copy), and, when a running capability can stop a
step (it overrides ``stop_now``), the RNG states (Python, NumPy, torch CPU and CUDA) and each such capability's
``state_dict()`` — except a capability that declares ``state_at_stop = "current"``: its state is written as it is
when the stop saves (the time budget's clock; a state that moves only at the optimizer step, which a cut step never
reaches, can declare it too and is not copied every step).

A copy of a large state at every step is a cost every step pays for a stop that rarely comes: a capability may offer
``boundary_state()`` instead, returning a function that gives its ``state_dict()`` as it was at the call (DUET
journals its per-prompt tables, :mod:`trl_fp8.duet.lru`, so a mark costs what a step changes, not what the tables
hold). :meth:`StepBoundary.state_dicts` calls those functions, once, when a stop saves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

BOUNDARY, CURRENT = "boundary", "current"  # a capability's state_at_stop


@dataclass
class StepBoundary:
    global_step: int
    step: int  # TRL's micro-step counter (which micro-batch of the generation buffer comes next)
    buffered_inputs: object  # TRL's generation buffer
    rng: dict | None = None
    states: dict = field(default_factory=dict)  # capability name -> its state_dict() then, or a function giving it

    def state_dicts(self) -> dict:
        """capability name -> its state_dict() at the boundary (a deferred one computed now, once)."""
        self.states = {name: state() if callable(state) else state for name, state in self.states.items()}
        return self.states

    def restore_rng(self) -> None:
        """Put the RNG streams back where they were (the checkpoint's RNG files are then the step end's)."""
        if self.rng is None:
            return
        random.setstate(self.rng["python"])
        np.random.set_state(self.rng["numpy"])
        torch.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng:
            torch.cuda.set_rng_state_all(self.rng["cuda"])


def _rng_states() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _copied(obj):
    """The containers of a ``state_dict()`` copied (a capability may hand out its live lists and dicts); tensors
    as given (a state_dict's tensors are its checkpoint copies)."""
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


def can_stop_mid_step(capability) -> bool:
    from ..capability import Capability

    return type(capability).stop_now is not Capability.stop_now


def mark(trainer) -> None:
    """Record the step boundary once per optimizer step, at its first micro-batch (see the module docstring)."""
    boundary = getattr(trainer, "_step_boundary", None)
    global_step = trainer.state.global_step
    if boundary is not None and boundary.global_step == global_step:
        return  # a later micro-batch of the same step
    caps = trainer.capabilities.values()
    stoppable = any(can_stop_mid_step(c) for c in caps)
    trainer._step_boundary = StepBoundary(
        global_step, trainer._step, trainer._buffered_inputs, rng=_rng_states() if stoppable else None,
        states={c.name: _state_then(c) for c in caps
                if stoppable and c.state_file is not None and c.state_at_stop == BOUNDARY})


def _state_then(capability):
    """The capability's state now: a function giving it (``boundary_state()``, where offered), else a copy."""
    deferred = getattr(capability, "boundary_state", None)
    return deferred() if callable(deferred) else _copied(capability.state_dict())
