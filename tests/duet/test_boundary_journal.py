"""DUET's state at a step boundary is journaled, not copied: a mark costs what the step then changes, not what the
per-prompt tables hold, and the state it gives back later is exactly the ``state_dict()`` of the mark's moment —
entries, LRU order, evictions and new prompts included."""

import copy
import random

import pytest
import torch

from trl_fp8.duet.controller import DuetController
from trl_fp8.duet.lru import LruTable
from trl_fp8.duet.passrate import PassRates
from trl_fp8.duet.surrogate import PromptStats


def test_a_table_at_its_mark_is_the_table_then_whatever_changed_since():
    rng = random.Random(0)
    table = LruTable(capacity=12, copy_entry=list)
    for trial in range(200):
        for _ in range(rng.randrange(0, 10)):  # history before the mark
            table.put(f"k{rng.randrange(30)}", [rng.random()])
        then = [(k, list(e)) for k, e in table.items()]
        mark = table.mark()
        for _ in range(rng.randrange(0, 25)):  # the step: inserts, evictions, moves, in-place changes
            op, key = rng.randrange(3), f"k{rng.randrange(30)}"
            if op == 0:
                table.put(key, [rng.random()])
            elif key in table:
                table.touch(key)
                if op == 2:
                    table.changing(key)
                    table[key][0] = -1.0
        assert [(k, list(e)) for k, e in table.items_at_mark(mark)] == then, trial
        assert len(table) <= 12


def test_an_old_mark_cannot_be_read_after_a_new_one_or_a_load():
    table = LruTable(capacity=4, copy_entry=list)
    old = table.mark()
    table.mark()
    with pytest.raises(RuntimeError, match="no longer"):
        table.items_at_mark(old)
    current = table.mark()
    table.load([("a", [1.0])])
    with pytest.raises(RuntimeError, match="no longer"):
        table.items_at_mark(current)


def _warm_controller(prompts: int) -> DuetController:
    c = DuetController(budget=0.5, slots=8, n_min=2, seed=0, default_length=10.0, allocator="pass_rate")
    c.pass_rates = PassRates(decay=0.5, capacity=prompts)
    c.stats = PromptStats(capacity=prompts, default_length=10.0)
    for i in range(prompts):
        c.pass_rates.update(f"p{i}", i % 3, 2)
        c.stats.update(f"p{i}", 0.1 * (i % 5), [10.0, 12.0])
    return c


def _step(c: DuetController, keys: list[str], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    plan = c.plan(keys)
    n = int(plan.counts.sum())
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    c.observe(plan, [10] * n, rewards - rewards.mean(), -torch.ones(n, dtype=torch.float64), rewards=rewards)


def test_the_controller_state_at_a_mark_is_its_state_dict_then():
    c = _warm_controller(50)
    _step(c, ["p1", "p2", "new-a"], 1)
    expected = copy.deepcopy(c.state_dict())
    state_then = c.mark()
    _step(c, ["p3", "p1", "new-b", "new-c"], 2)  # warm and new prompts; the tables are full: evictions too
    _step(c, ["p49", "new-d"], 3)
    assert c.state_dict() != expected
    assert state_then() == expected


def test_a_boundary_mark_journals_only_what_the_step_changes(monkeypatch):
    """Proportional to what changed: after a mark, the journals hold the step's prompts (and what they evicted), not
    the 2000 of the tables; the full state_dict is not built at the mark."""
    from trl_fp8.duet.component import Duet

    c = _warm_controller(2000)
    component = Duet.__new__(Duet)
    component.controller = c
    for cls in (PassRates, PromptStats):
        monkeypatch.setattr(cls, "state_dict", lambda self: pytest.fail("the whole table was copied at the mark"))
    state_then = component.boundary_state()
    _step(c, ["p1", "p2", "new-a", "new-b"], 4)
    assert 0 < len(c.pass_rates._table._journal) <= 4 + 2 and 0 < len(c.stats._table._journal) <= 4 + 2
    monkeypatch.undo()
    state = state_then()
    assert state["format"] == 1 and len(state["controller"]["pass_rates"]["table"]) == 2000
    assert "new-a" not in {row[0] for row in state["controller"]["pass_rates"]["table"]}
