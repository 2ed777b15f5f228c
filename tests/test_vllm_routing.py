"""The LoRA slot each token reads against its request's adapter (trl_fp8/_trl/vllm_routing.py), on a stand-in for
vLLM's LoRA manager and punica wrapper (the real engine: tests/test_vllm_lora.py, tests/test_vllm_server_adapters.py)."""

import types

import torch

from trl_fp8._trl.vllm_routing import RouteGuard, merge
from trl_fp8.sync_checks import checks as C


class _Wrapper:
    """A punica wrapper's per-token slot indices (padded buffer + its live length, as vLLM keeps them)."""

    def __init__(self):
        self._indices = torch.full((64,), -7, dtype=torch.long)
        self.length = 0

    @property
    def token_lora_indices(self):
        return self._indices[: self.length]


class _Manager:
    """vLLM's LoRA manager as far as routing goes: slots (``lora_index_to_id``) and ``set_adapter_mapping``, which
    builds the per-token slot indices — memoised on the mapping alone with ``stale_memo`` (the behaviour of vLLM
    issue 47724), on the mapping and the slot layout otherwise (the fix)."""

    def __init__(self, slots=2, stale_memo=False):
        self.lora_index_to_id = [None] * slots
        self.punica_wrapper = _Wrapper()
        self.stale_memo = stale_memo
        self._memo = None

    def set_adapter_mapping(self, mapping):
        key = mapping.index_mapping if self.stale_memo else (mapping.index_mapping, tuple(self.lora_index_to_id))
        if key == self._memo:
            return
        self._memo = key
        slot_of = {i: s for s, i in enumerate(self.lora_index_to_id) if i is not None}
        indices = [slot_of[i] if i > 0 else -1 for i in mapping.index_mapping]
        self.punica_wrapper._indices[: len(indices)] = torch.tensor(indices)
        self.punica_wrapper.length = len(indices)


def _mapping(*ids):
    return types.SimpleNamespace(index_mapping=tuple(ids), prompt_mapping=tuple(ids),
                                 type=types.SimpleNamespace(name="LANGUAGE"))


def test_tokens_read_the_slots_of_their_requests_adapters():
    manager = _Manager()
    manager.lora_index_to_id = [5, 6]
    guard = RouteGuard.install(manager)
    manager.set_adapter_mapping(_mapping(5, 5, 6, 0))
    manager.set_adapter_mapping(_mapping(6, 0))
    copied = guard._wanted_ids
    manager.set_adapter_mapping(_mapping(6, 0))  # a decoding batch keeps its mapping: its ids are not copied again
    assert guard._wanted_ids is copied
    assert guard.take() == {"tokens": 8, "forwards": 3, "misrouted": 0, "example": None}
    assert guard.take()["tokens"] == 0  # read once, then forgotten
    assert RouteGuard.install(manager) is guard  # installed once per manager


def test_a_slot_reused_under_an_unchanged_mapping_is_a_misrouted_token_named_by_both_ids():
    """vLLM issue 47724: an out-of-band add_lora evicts the slot of a running request's adapter and the memo, keyed
    on the mapping alone, keeps the old per-token slots: the request names adapter 5, its tokens read adapter 7's
    slot. The same sequence with the layout in the memo (the fix) routes every token right."""
    for stale, expected in ((True, 2), (False, 0)):
        manager = _Manager(stale_memo=stale)
        manager.lora_index_to_id = [5, 6]
        guard = RouteGuard.install(manager)
        manager.set_adapter_mapping(_mapping(6, 6))
        manager.lora_index_to_id = [6, 5]  # the LRU moved the adapters between slots; the batch is unchanged
        manager.set_adapter_mapping(_mapping(6, 6))
        got = guard.take()
        assert got["misrouted"] == expected and got["tokens"] == 4
        if stale:
            assert got["example"] == [6, 5]


def test_a_token_computed_without_its_adapter_or_with_one_it_never_asked_for_is_misrouted():
    manager = _Manager(slots=1)
    manager.lora_index_to_id = [3]
    guard = RouteGuard.install(manager)
    manager.set_adapter_mapping(_mapping(3, 3, 0))
    manager.punica_wrapper._indices[:3] = torch.tensor([-1, 0, 0])  # overwritten after the build
    guard.observe(_mapping(3, 3, 0))
    got = guard.take()
    assert got["misrouted"] == 2 and got["tokens"] == 6
    assert got["example"] in ([3, 0], [0, 3])


def test_what_cannot_be_read_is_said_not_passed():
    manager = _Manager()
    manager.lora_index_to_id = [5, None]
    manager.punica_wrapper = None
    guard = RouteGuard.install(manager)
    manager.set_adapter_mapping = lambda mapping: guard.observe(mapping)  # no wrapper to build
    guard.observe(_mapping(5))
    got = guard.take()
    assert got["tokens"] == 0 and "could not be read" in got["unreadable"]
    result = C.rollout_routing(3, got)
    assert result.passed and not result.applicable and "could not be read" in result.message


def test_another_mapping_kind_is_not_the_language_models():
    manager = _Manager()
    manager.lora_index_to_id = [5, None]
    guard = RouteGuard.install(manager)
    tower = types.SimpleNamespace(index_mapping=(5,), prompt_mapping=(5,), type=types.SimpleNamespace(name="TOWER"))
    guard.observe(tower)
    assert guard.take()["tokens"] == 0


def test_the_check_names_the_versions_of_both_ids_and_counts_the_tokens():
    labels = {5: 2, 6: 3}
    ok = C.rollout_routing(4, {"tokens": 12, "misrouted": 0, "example": None}, labels.get)
    assert ok.passed and ok.applicable and ok.metrics == {"tokens_routed": 12.0}
    bad = C.rollout_routing(4, {"tokens": 12, "misrouted": 3, "example": [6, 5]}, labels.get)
    assert not bad.passed and bad.check == "freshness"
    assert "3 of 12 tokens" in bad.message and "at step 4" in bad.message
    assert "named LoRA id 6 (adapter version 3) read the slot of LoRA id 5 (adapter version 2)" in bad.message
    none = C.rollout_routing(4, {"tokens": 2, "misrouted": 1, "example": [6, 0]}, labels.get)
    assert "read the slot of no adapter (the bare base)" in none.message
    foreign = C.rollout_routing(4, {"tokens": 2, "misrouted": 1, "example": [6, 9]}, labels.get)
    assert "LoRA id 9 (no version the learner pushed)" in foreign.message
    assert not C.rollout_routing(4, None).applicable
    assert not C.rollout_routing(4, {"tokens": 0, "misrouted": 0}).applicable


def test_workers_merge_to_the_largest_count_and_keep_one_example():
    merged = merge([{"tokens": 8, "forwards": 2, "misrouted": 0, "example": None},
                    {"tokens": 8, "forwards": 2, "misrouted": 1, "example": [4, 0]}, None])
    assert merged == {"tokens": 8, "forwards": 2, "misrouted": 1, "example": [4, 0]}
