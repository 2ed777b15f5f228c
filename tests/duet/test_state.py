"""DUET's controller state round-trips exactly through a checkpoint file: a controller restored from it plans, stops
and weights the next batches exactly as the one that kept running."""

import math

import torch

from trl_fp8.duet.controller import DuetController
from trl_fp8.duet.surrogate import LengthQuantiles, PromptStats

SLOTS = 4
KEYS = [f"prompt-{i}" for i in range(6)]


def _controller() -> DuetController:
    c = DuetController(budget=0.6, slots=SLOTS, n_min=1, keep_prob=0.3, seed=11, default_length=20.0)
    c.quantiles = LengthQuantiles(refit_every=2, min_count=8)  # calibrate within a few rounds
    c.stats = PromptStats(default_length=20.0, reprobe_every=2)
    return c


def _round(c: DuetController, r: int) -> dict:
    """One batch: plan, feed every monitor token by token (markers on some rollouts, so the RNG is drawn for the trim
    coin, and long marker-less ones past k2 + grace, so the abort coin is drawn), learn from it. Returns what the
    controller decided."""
    gen = torch.Generator().manual_seed(1000 + r)
    keys = [KEYS[(r + i) % len(KEYS)] for i in range(3)]
    plan = c.plan(keys)
    lengths = []
    for i, monitor in enumerate(plan.monitors):
        marker_at = 8 if (i + r) % 3 == 0 else None
        stop_at = None
        for t in range(1, 200):
            tail = ("\\boxed{7}" if marker_at is not None and t >= marker_at else "thinking") if t % 8 == 0 else None
            monitor.step(t, float(torch.rand((), generator=gen)) * 1.2, tail)
            if monitor.done:
                stop_at = t
                break
        lengths.append(stop_at or int(torch.randint(5, 40, (), generator=gen)))
    n = len(plan.monitors)
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    sum_logps = -torch.rand(n, generator=gen, dtype=torch.float64) * 30
    c.observe(plan, lengths, advantages, sum_logps)
    return {
        "counts": plan.counts.tolist(), "propensity": plan.propensity.tolist(), "lam": plan.lam,
        "aborted": [m.aborted for m in plan.monitors], "stopped": [m.stopped for m in plan.monitors],
        "eps_kept": [m.eps_kept for m in plan.monitors], "trim": [m.trim_armed for m in plan.monitors],
        "weights": c.weights(plan).tolist(), "lengths": lengths,
    }


def test_controller_state_round_trips_exactly(tmp_path):
    a = _controller()
    for r in range(6):
        _round(a, r)
    state = a.state_dict()
    # the rounds exercised what the state holds: warm prompts, calibrated quantiles, a drawn RNG
    assert len(state["stats"]["table"]) > 0 and math.isfinite(state["quantiles"]["k1"])
    assert state["rng"]["internal"] != list(_controller().rng.getstate()[1])
    path = tmp_path / "duet_state.pt"
    torch.save(state, path)

    b = _controller()
    b.load_state_dict(torch.load(path, weights_only=True))
    assert b.state_dict() == state
    assert list(b.stats._table) == list(a.stats._table)  # LRU order too
    for r in range(6, 14):
        assert _round(b, r) == _round(a, r), r
    assert b.state_dict() == a.state_dict()
    assert b.rng.random() == a.rng.random()


def test_a_fresh_controller_decides_differently():
    """The round-trip test has teeth: without the state, the same batches are planned differently."""
    a = _controller()
    for r in range(6):
        _round(a, r)
    fresh = _controller()
    assert [_round(fresh, r) for r in range(6, 10)] != [_round(a, r) for r in range(6, 10)]


def test_the_duet_capability_saves_and_restores_its_controller():
    from trl_fp8.duet.component import Duet

    a, b = Duet(), Duet()
    a.controller, b.controller = _controller(), _controller()
    for r in range(4):
        _round(a.controller, r)
    assert Duet.state_file == "duet_state.pt"
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
