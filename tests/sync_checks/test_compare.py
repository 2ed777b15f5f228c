"""Bit-for-bit comparison: every path (compiled kernels, memcmp, torch) gives the same answer, names the first pair
that differs, and groups and chunks as it should."""

import pytest
import torch

from trl_fp8.sync_checks import compare


def test_bitwise_equal_compares_bits_in_any_word_width(compare_path):
    a = torch.randn(5, 3).bfloat16()  # 30 bytes: compared as 2-byte words
    assert compare.bitwise_equal(a, a.clone())
    flipped = a.clone()
    flipped[1, 1] = -flipped[1, 1]
    assert not compare.bitwise_equal(a, flipped)
    zeros = torch.zeros(8)  # 32 bytes: int64 words
    assert not compare.bitwise_equal(zeros, -zeros) and compare.bitwise_equal(zeros, zeros.clone())  # -0 is not +0
    nan = torch.full((4,), float("nan"))
    assert compare.bitwise_equal(nan, nan.clone())  # the same payload
    other_nan = nan.view(torch.int32).clone()
    other_nan[2] += 1
    assert not compare.bitwise_equal(nan, other_nan.view(torch.float32))
    shifted = torch.randn(9)[1:]  # a 4-byte offset: int32 words on one side, int64 on the other's own
    assert compare.bitwise_equal(shifted, shifted.clone())
    changed = shifted.clone()
    changed[-1] += 1
    assert not compare.bitwise_equal(shifted, changed)
    assert compare.bitwise_equal(torch.randn(3, 4).t().contiguous(), torch.randn(3, 4).t().contiguous()) is False
    t = torch.randn(3, 4).t()
    assert compare.bitwise_equal(t, t.clone())  # non-contiguous
    assert not compare.bitwise_equal(torch.tensor([True, False]), torch.tensor([True, True]))
    assert compare.bitwise_equal(torch.empty(0, 3), torch.empty(0, 3))
    assert compare.bitwise_equal(torch.arange(5), torch.arange(5)) and not compare.bitwise_equal(torch.arange(5), torch.arange(5) * 2)
    z = torch.randn(4, dtype=torch.complex64)
    assert compare.bitwise_equal(z, z.clone()) and not compare.bitwise_equal(z, z.conj())
    assert not compare.bitwise_equal(torch.ones(4), torch.ones(2, 2)) and not compare.bitwise_equal(torch.ones(4),
                                                                                          torch.ones(4).double())


@pytest.mark.parametrize("group", [1, 7, 64, 1 << 20])
def test_pair_comparer_finds_the_first_differing_pair_in_groups_and_chunks(monkeypatch, group, compare_path):
    monkeypatch.setattr(compare, "COMPARE_GROUP_ELEMENTS", group)
    monkeypatch.setattr(compare, "NATIVE_BATCH_BYTES", 4 * group)
    g = torch.Generator().manual_seed(group)
    refs = [torch.randn(n, generator=g).bfloat16().float() for n in (3, 10, 40, 200, 5, 6)]
    served = [r.bfloat16() for r in refs]

    def run(pairs):
        comparer = compare.PairComparer()
        for i, (a, b) in enumerate(pairs):
            if not comparer.add(i, a, b):
                break
        found = comparer.finish()
        return None if found is None else found[0]

    assert run(list(zip(refs, served))) is None  # widened exactly: equal
    for wrong in (1, 3, 5):
        bad = [s.clone() for s in served]
        bad[wrong].view(torch.int16)[-1] += 1  # one bit of the last element
        also = [s.clone() for s in bad]
        also[4].view(torch.int16)[0] += 1  # a later pair differs too: the first is reported
        assert run(list(zip(refs, bad))) == wrong
        assert run(list(zip(refs, also))) == min(wrong, 4)
    inexact = [r.clone() for r in refs]
    inexact[2][7] += 1e-6  # not a bf16 value: no served tensor widens to it
    assert run(list(zip(inexact, served))) == 2
    reshaped = list(served)
    reshaped[3] = served[3].view(10, 20)
    assert run(list(zip(refs, reshaped))) == 3
    same = [s.clone() for s in served]  # the same dtype on both sides: no conversion
    assert run(list(zip(served, same))) is None


def test_pair_comparer_holds_at_most_what_the_memory_plan_counts(monkeypatch, compare_path):
    """Host pairs wait for one call until their first sides pass NATIVE_BATCH_BYTES (off the host a group holds at
    most COMPARE_GROUP_ELEMENTS elements): the bounds the plan's rows are made of."""
    from trl_fp8.sync_checks import memory

    assert compare.NATIVE_BATCH_BYTES == memory.HOST_BATCH_BYTES
    assert compare.COMPARE_GROUP_ELEMENTS == memory.COMPARE_GROUP_ELEMENTS
    monkeypatch.setattr(compare, "NATIVE_BATCH_BYTES", 100)
    comparer, most = compare.PairComparer(), 0
    for i in range(10):
        a = torch.full((10,), float(i))  # 40 bytes each
        assert comparer.add(i, a, a.bfloat16())
        most = max(most, comparer._host_bytes)
    assert comparer.finish() is None and most <= 100
    if compare_path == "native":
        assert most > 40  # pairs did wait for one call (elsewhere each is compared as it comes)


def test_the_plan_counts_one_comparison_group_where_a_sync_is_checked():
    from types import SimpleNamespace

    from trl_fp8.sync_checks import memory

    def spec(checks, kind="twin"):  # a twin, or TRL without vLLM (the learner generates)
        return SimpleNamespace(args=SimpleNamespace(sync_checks=checks), decision=SimpleNamespace(kind=kind),
                               vllm="off", base_params=1000,
                               rollout=SimpleNamespace(generation_batch=8, completion_length=16))

    def group_rows(s):
        return [r for r in memory.memory_rows(s) if "compared bit for bit" in r.item]

    [row] = group_rows(spec("default"))
    assert row.bytes == memory.COMPARE_GROUP_ELEMENTS * memory.GROUP_BYTES_PER_ELEMENT and not row.exact
    assert group_rows(spec("logprob_agreement")) == [] and group_rows(spec("default", "trl")) == []


def test_a_storage_released_while_queued_is_never_read_and_is_named():
    """FSDP and ZeRO-3 release a sharded parameter's storage after its gather (``resize_(0)``): a pair queued for the
    one deferred call into the compiled comparison must not be read through its old address."""
    from trl_fp8.sync_checks import checks as C
    from trl_fp8.sync_checks.compare import PairComparer, StorageReleased, _native_lib

    if _native_lib() is None:
        pytest.skip("no compiled kernels here: host pairs are compared at once, nothing waits")
    a = torch.randn(64, 64)
    comparer = PairComparer()
    assert comparer.add("w", a, a.clone())
    assert comparer.add("v", torch.ones(8), torch.ones(8))  # a healthy pair after it
    a.untyped_storage().resize_(0)  # released as FSDP releases it
    with pytest.raises(StorageReleased, match="'w': its storage was released"):
        comparer.finish()
    sent = {"x": torch.randn(32, 32)}
    served = sent["x"].clone()

    def read(name):
        return served

    result = C.freshness(3, None, sent, read, {})
    assert result.passed
    original = PairComparer.finish

    def release_then_finish(self):  # the sampler's copy is released between the check's add() and its finish()
        served.untyped_storage().resize_(0)
        return original(self)

    PairComparer.finish = release_then_finish
    try:
        result = C.freshness(3, None, sent, read, {})
    finally:
        PairComparer.finish = original
    assert not result.passed and "'x': its storage was released" in result.message and "(step 3)" in result.message


def test_a_meta_tensor_fails_the_checks_by_name_instead_of_raising():
    from trl_fp8.sync_checks import checks as C

    sent = {"w": torch.randn(4, 4)}
    meta = torch.empty(4, 4, device="meta")
    result = C.freshness(2, None, sent, lambda n: meta, {})
    assert not result.passed and "'w' is a meta tensor on the sampler's side at step 2" in result.message
    result = C.freshness(2, None, {"w": meta}, lambda n: sent["w"], {})
    assert not result.passed and "on the learner's side" in result.message
    result = C.quant_parity(["w"], lambda n: sent["w"], lambda n: meta)
    assert not result.passed and "'w' is a meta tensor on the sampler's side" in result.message
    assert "meta tensor" in C.compare_states("A vs B", {"w": meta}, {"w": meta})
