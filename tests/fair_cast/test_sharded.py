"""Shard invariance of the export: shards rounded with their global element offset give the one-process bits, and
a copy over shards (any split, any number of 'ranks') serves what one process serves, step after step, through a
checkpoint, re-sharded onto another number of ranks. Here the shards are views of one process's tensors; the 2-rank
FSDP2 / DeepSpeed tests are in tests/distributed."""

import os

import pytest
import torch

from trl_fp8 import native as _native
from trl_fp8.fair_cast import rounding
from trl_fp8.fair_cast.served import ParamUnit, ServedCopy
from trl_fp8.fair_cast.sharded import (ShardUnit, load_sharded_state, reshard, save_sharded_state,
                                       shard_state_file, sharded_state_dict)


def _cuts(n, parts, seed):
    g = torch.Generator().manual_seed(seed)
    inner = sorted(torch.randperm(n - 1, generator=g)[: parts - 1].add(1).tolist())
    return [0, *inner, n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_offsets_make_shards_round_like_the_whole_tensor(dtype):
    x = torch.randn(997) * 3
    whole = rounding.stochastic_round(x, dtype, seed=5, step=9, index=3)
    cuts = _cuts(x.numel(), 5, 1)
    pieces = [rounding.stochastic_round(x[a:b].clone(), dtype, seed=5, step=9, index=3, offset=a)
              for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(pieces).view(torch.int16), whole.view(torch.int16))
    shifted = rounding.stochastic_round(x[100:].clone(), dtype, seed=5, step=9, index=3)  # no offset: other bits
    assert not torch.equal(shifted.view(torch.int16), whole[100:].view(torch.int16))


def test_native_and_torch_kernels_agree_with_an_offset():
    lib = _native.load()
    if lib is None:
        pytest.skip("no C compiler here")
    x = torch.randn(4099)
    key = rounding.derive_key(1, 2, 3)
    for offset in (0, 1, 4096, 2**33 + 7):
        native = _native.sr_bf16(lib, x, None, key, 2, offset=offset)
        reference = rounding._sr_bf16_bits_torch(x, key, offset)
        assert torch.equal(native.view(torch.int16), reference.view(torch.int16)), offset
    with pytest.raises(ValueError, match="offset must be an int"):
        _native.sr_bf16(lib, x, None, key, 1, offset=-1)


SHAPES = {"embed": (13, 6), "w1": (10, 6), "b1": (10,), "w2": (13, 10)}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(*s, generator=g) * 0.05) for n, s in SHAPES.items()}


def _row_split(shape, world, rank):
    """FSDP2's Shard(0): rows chunked with ceil(rows / world)."""
    rows = shape[0]
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    inner = 1
    for d in shape[1:]:
        inner *= d
    return start * inner, stop * inner


def _shard_copy(full, mode, world, rank, split="rows"):
    """A ServedCopy over this virtual rank's shards (flat views of the full parameters)."""
    units = []
    for index, (name, p) in enumerate(full.items()):
        if split == "rows":
            a, b = _row_split(p.shape, world, rank)
        else:  # arbitrary flat segments (ZeRO-like)
            cuts = [round(p.numel() * r / world) for r in range(world + 1)]
            a, b = cuts[rank], cuts[rank + 1]
        units.append(ShardUnit(name, p.data.view(-1)[a:b], a, index, p.numel()))
    return ServedCopy(units, mode, torch.bfloat16, seed=21)


def _drift(params, step):
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g) * 3e-4)


def _assembled(copies, full):
    out = {}
    for name, p in full.items():
        flat = torch.empty(p.numel(), dtype=torch.bfloat16)
        for c in copies:
            u = c.units[name]
            flat[u.offset:u.offset + u.master.numel()] = c.served[name].view(-1)
        out[name] = flat.view(p.shape)
    return out


@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
@pytest.mark.parametrize("world,split", [(2, "rows"), (3, "rows"), (3, "flat"), (20, "rows")])
def test_shards_serve_the_one_process_bits_over_steps(mode, world, split):
    reference_params, sharded_params = _params(), _params()
    reference = ServedCopy([ParamUnit(n, p) for n, p in reference_params.items()], mode, torch.bfloat16, seed=21)
    copies = [_shard_copy(sharded_params, mode, world, r, split) for r in range(world)]
    reference.begin(0)
    for c in copies:
        c.begin(0)
    for step in range(1, 5):
        for params, cs in ((reference_params, [reference]), (sharded_params, copies)):
            for c in cs:
                c.before_step()
            _drift(params, step)  # the optimizer steps the masters (the same update on both sides)
            for c in cs:
                c.after_step(step)
        served = _assembled(copies, sharded_params)
        for name in SHAPES:
            assert torch.equal(served[name].view(torch.int16), reference.served[name].view(torch.int16)), (step, name)
            assert torch.equal(sharded_params[name].data, reference_params[name].data)  # loss on the served values


@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
def test_checkpoint_resumes_exactly_and_reshards_onto_another_world_size(tmp_path, mode):
    def run(world, steps, start=0, copies=None, params=None):
        params = params or _params()
        if copies is None:
            copies = [_shard_copy(params, mode, world, r) for r in range(world)]
            for c in copies:
                c.begin(start)
        for step in range(start + 1, start + steps + 1):
            for c in copies:
                c.before_step()
            _drift(params, step)
            for c in copies:
                c.after_step(step)
        return params, copies

    straight_params, straight = run(1, 4)
    params, two = run(2, 2)  # two ranks, two steps, checkpoint
    for r, c in enumerate(two):
        save_sharded_state(c, str(tmp_path), r, 2)
    assert sorted(os.listdir(tmp_path)) == [shard_state_file(0), shard_state_file(1)]
    for world in (2, 3):  # the same world size (exact load of each rank's own file) and another one (re-shard)
        resumed_params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
        copies = [_shard_copy(resumed_params, mode, world, r) for r in range(world)]
        for r, c in enumerate(copies):
            load_sharded_state(c, str(tmp_path), r, world)
            c.begin(2, restored=True)
        run(world, 2, start=2, copies=copies, params=resumed_params)
        served = _assembled(copies, resumed_params)
        for name in SHAPES:
            expected = straight[0].served[name].view(torch.int16)
            assert torch.equal(served[name].view(-1).view(torch.int16), expected), name
            assert torch.equal(resumed_params[name].data, straight_params[name].data), name


def test_reshard_refuses_incomplete_or_foreign_states(tmp_path):
    params = _params()
    two = [_shard_copy(params, "error_feedback", 2, r) for r in range(2)]
    target = _shard_copy(_params(), "error_feedback", 3, 0)
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        reshard(target, [sharded_state_dict(two[1], 1, 2)])  # rank 0's elements are missing
    with pytest.raises(ValueError, match="mode="):
        reshard(_shard_copy(_params(), "stochastic", 3, 0), [sharded_state_dict(c, r, 2) for r, c in enumerate(two)])
    save_sharded_state(two[0], str(tmp_path), 0, 2)  # rank 1's file lost
    with pytest.raises(ValueError, match=f"{shard_state_file(1)} is missing"):
        load_sharded_state(target, str(tmp_path), 0, 3)
    with pytest.raises(ValueError, match=f"has no {shard_state_file(2)}"):
        load_sharded_state(_shard_copy(_params(), "error_feedback", 3, 2), str(tmp_path / "empty"), 2, 3)


def test_reshard_and_shard_units_name_what_is_wrong():
    from trl_fp8.fair_cast.sharded import PartitionUnit

    params = _params()
    two = [_shard_copy(params, "error_feedback", 2, r) for r in range(2)]
    target = _shard_copy(_params(), "error_feedback", 3, 0)
    with pytest.raises(ValueError, match="nothing to re-shard from"):
        reshard(target, [])
    states = [sharded_state_dict(c, r, 2) for r, c in enumerate(two)]
    name = next(iter(params))
    for s in states:
        del s["sharded"]["layout"][name]
    with pytest.raises(ValueError, match=f"lacks the state of '{name}'"):
        reshard(target, states)
    states = [sharded_state_dict(c, r, 2) for r, c in enumerate(two)]
    for s in states:
        index, offset, numel, full = s["sharded"]["layout"][name]
        s["sharded"]["layout"][name] = (index, offset, numel, full + 1)
    with pytest.raises(ValueError, match=rf"'{name}' has {params[name].numel() + 1} elements there, "
                                         rf"{params[name].numel()} here"):
        reshard(target, states)
    half = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(TypeError, match="needs fp32 master shards, but 'w' is sharded as torch.float16"):
        ShardUnit("w", half, 0, 0, 8)
    with pytest.raises(TypeError, match="needs DeepSpeed's fp32 master partitions, but 'w' has torch.float16"):
        PartitionUnit("w", half, 0, 0, 8)
