"""DUET's cold start (screening): a prompt never seen gets a small screening group first and the rest of its
rollouts only where the screen's rewards differ (else with probability keep_prob, weighted 1/keep_prob); the
rollouts freed by uniform screens go to the mixed ones; nothing changes where every screen is mixed."""

import random

import pytest
import torch

from trl_fp8.duet.controller import DuetController

KEYS = [f"q{i}" for i in range(4)]


def _controller(screen=2, keep=0.1, seed=0, **kw) -> DuetController:
    return DuetController(budget=0.5, slots=8, n_min=2, screen=screen, screen_keep_prob=keep, seed=seed,
                          default_length=20.0, **kw)


class _Zeros(random.Random):
    """Every draw is 0.0: every uniform screen continues (0 < keep_prob), every coin of a monitor too."""

    def random(self):
        return 0.0


def test_cold_prompts_get_a_screen_and_the_allocators_counts_are_kept():
    plan = _controller().plan(KEYS)
    assert plan.planned.tolist() == [4, 4, 4, 4]  # β = 0.5 of 8 slots, all cold: uniform
    assert plan.counts.tolist() == [2, 2, 2, 2] and plan.screened.tolist() == [True] * 4
    assert len(plan.monitors) == 8 and plan.real_rows() == [0, 1, 8, 9, 16, 17, 24, 25]
    off = _controller(screen=0).plan(KEYS)
    assert off.counts.tolist() == [4, 4, 4, 4] and not off.screened.any()


def test_all_mixed_screens_end_exactly_where_the_allocator_did():
    """Where every group is informative screening changes nothing: same counts, propensities, inclusion and weights
    as without screening (only the generation is split in two passes)."""
    c = _controller()
    plan = c.plan(KEYS)
    new_rows = c.after_screen(plan, [False, False, False, False])
    assert new_rows == [2, 3, 10, 11, 18, 19, 26, 27]
    off = _controller(screen=0).plan(KEYS)
    assert torch.equal(plan.counts, off.counts) and torch.equal(plan.propensity, off.propensity)
    assert torch.equal(plan.inclusion, off.inclusion)
    assert len(plan.monitors) == 16 and torch.equal(c.weights(plan), _controller(screen=0).weights(off))


def test_uniform_screens_free_their_rollouts_for_the_mixed_ones():
    c = _controller(keep=1e-12)  # a uniform screen (practically) never continues
    plan = c.plan(KEYS)
    new_rows = c.after_screen(plan, [True, False, True, False])
    assert plan.counts.tolist() == [2, 6, 2, 6]  # the 8 freed rollouts: 4 more to each mixed prompt
    assert new_rows == [10, 11, 12, 13, 26, 27, 28, 29]
    assert plan.screen_uniform == [True, False, True, False]
    assert plan.inclusion.tolist() == [1.0] * 4  # the stopped ones keep π = 1: their screens are in the batch
    # capped at n_max: one mixed prompt cannot take all 8 freed rollouts beyond its 8 slots
    c = _controller(keep=1e-12)
    plan = c.plan(KEYS)
    c.after_screen(plan, [True, True, True, False])
    assert plan.counts.tolist() == [2, 2, 2, 8]
    # unknown (fewer than 2 kept screen rollouts) counts as mixed
    c = _controller(keep=1e-12)
    plan = c.plan(KEYS)
    c.after_screen(plan, [None, True, True, True])
    assert plan.counts.tolist() == [8, 2, 2, 2]


def test_a_continued_uniform_screen_is_weighted_one_over_keep_prob():
    c = _controller(keep=0.25)
    plan = c.plan(KEYS)
    c.rng = _Zeros()  # the continuation coins: 0.0 < 0.25, every uniform screen continues
    c.after_screen(plan, [True, False, False, False])
    assert plan.counts.tolist() == [4, 4, 4, 4]
    assert plan.inclusion.tolist() == [0.25, 1.0, 1.0, 1.0]
    w = c.weights(plan)
    assert w[:4].tolist() == pytest.approx([4.0] * 4) and w[4:].tolist() == pytest.approx([1.0] * 12)


def test_screening_is_unbiased_over_the_coin():
    """Over the continuation coin, a uniform-screened prompt's expected weight x indicator of continuing is 1: the
    weight it would have had with a full group (frequencies from the controller's own seeded stream)."""
    total, trials = 0.0, 1500
    for seed in range(trials):
        c = _controller(keep=0.2, seed=seed)
        plan = c.plan(KEYS[:2])
        c.after_screen(plan, [True, False])
        if plan.counts[0] > 2:
            total += float(c.weights(plan)[0])
    assert total / trials == pytest.approx(1.0, abs=0.16)  # about 3 sd of the mean


def test_warm_prompts_are_not_screened_and_bad_input_is_refused():
    c = _controller()
    plan = c.plan(KEYS)
    c.after_screen(plan, [False] * 4)
    lengths = [10] * int(plan.counts.sum())
    advantages = torch.tensor([0.01, -0.01] * (len(lengths) // 2), dtype=torch.float64)  # small ŝ: the cold
    c.observe(plan, lengths, advantages, -torch.ones(len(lengths), dtype=torch.float64))  # prior 1.0 gets more
    again = c.plan(KEYS + ["new"])
    assert again.screened.tolist() == [False, False, False, False, True] and again.planned[4] > 2
    with pytest.raises(ValueError, match="one entry per screened prompt \\(1\\)"):
        c.after_screen(again, [True, False])


def test_length_knobs_scale_with_the_completion_cap():
    from types import SimpleNamespace

    from trl_fp8.duet.component import length_knobs

    unset = SimpleNamespace(duet_abort_grace=None, duet_abort_min_tokens=None, duet_poll_every=None)
    assert length_knobs(unset, 3072) == {"grace": 150, "min_tokens": 200, "k_gap": 50, "poll_every": 8}
    assert length_knobs(unset, 128) == {"grace": 8, "min_tokens": 8, "k_gap": 2, "poll_every": 1}
    assert length_knobs(unset, 6144) == {"grace": 300, "min_tokens": 400, "k_gap": 100, "poll_every": 16}
    chosen = SimpleNamespace(duet_abort_grace=5, duet_abort_min_tokens=0, duet_poll_every=4)
    assert length_knobs(chosen, 128) == {"grace": 5, "min_tokens": 0, "k_gap": 2, "poll_every": 4}
    # the monitors get them: nothing stops before min_tokens, K2 >= K1 + gap, the poll period
    c = _controller(min_tokens=30, k_gap=7, poll_every=3)
    c.quantiles.k1, c.quantiles.k2 = 10.0, 12.0
    m = c.plan(KEYS).monitors[0]
    assert (m.k1, m.k2, m.poll_every) == (30, 37, 3)
