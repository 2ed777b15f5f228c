"""Fair Cast over sharded parameters (FSDP2, DeepSpeed ZeRO): the same served bits on any number of processes.

A sharded process holds, of each tensor, a contiguous run of its flattened elements (FSDP2: rows of dim 0; ZeRO:
segments of flat partitions). The export keys its random bits by (seed, step, tensor index, *global* element index)
(:func:`~trl_fp8.fair_cast.rounding.stochastic_round`'s ``offset``), and error feedback is element-wise with its
residual kept per shard, so the served copy assembled from N shards is bit for bit the one-process export of the
assembled master — for every N. Pure PyTorch; the engine adapters only say where the shards are.

- :class:`ShardUnit`: one tensor's shard as a :class:`~trl_fp8.fair_cast.served.ServedCopy` unit (``offset``: the
  global flat index of its first element, ``index``: the tensor's one-process index). A ``ServedCopy`` over shard
  units runs the usual cycle (master <- shard; export; shard <- served values; the optimizer steps the master).
- :func:`fsdp2_units`: the units of a model wrapped with torch's ``fully_shard`` (``Shard(0)`` DTensors). The
  parameters hold the served values between steps, so FSDP's all-gather (in fp32, or in the served dtype with
  ``MixedPrecisionPolicy(param_dtype=served dtype)``) sends exactly the served bits, and ``full_tensor()`` (TRL's
  sync) is the served copy.
- :func:`deepspeed_units` and :class:`DeepSpeedExport`: ZeRO-1/2/3. DeepSpeed's own fp32 partitions are the master;
  inside ``optimizer.step()`` the export writes the served values into them just before DeepSpeed copies them to its
  16-bit partitions (now exact) and all-gathers, and puts the master back when the step returns.
- Checkpoints: :func:`shard_state_file` names each rank's file; :func:`load_sharded_state` restores exactly on the
  same world size and re-shards from every rank's file on another one (each element's master, served value and EF
  residual are found by its global index).
"""

from __future__ import annotations

import math
import os

import torch

from .served import ParamUnit, ServedCopy

STATE_PREFIX = "fair_cast_state"


class ShardUnit(ParamUnit):
    """The shard this process holds of one tensor: ``local`` (a tensor viewing the engine's storage; it holds the
    served values between steps), the flat elements ``[offset, offset + local.numel())`` of tensor ``index`` (of
    ``full_numel`` elements) in the one-process order."""

    def __init__(self, name: str, local: torch.Tensor, offset: int, index: int, full_numel: int,
                 trainable: bool = True):
        if local.dtype != torch.float32:
            raise TypeError(f"Fair Cast needs fp32 master shards, but '{name}' is sharded as {local.dtype}.")
        self.name = name
        self.param = local  # ParamUnit's capture/restore/apply act on it
        self.trainable = trainable
        self.master = local.detach().clone()
        self.offset = int(offset)
        self.index = int(index)
        self.full_numel = int(full_numel)


def _shard0_offset(param, local: torch.Tensor) -> int:
    """Global flat index of the first local element of a ``Shard(0)`` DTensor (torch.chunk over the mesh)."""
    from torch.distributed.tensor import Shard

    placements = tuple(param.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"Fair Cast over FSDP2 expects parameters sharded on dim 0 (Shard(0)), got {placements}.")
    mesh = param.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = param.shape[0]
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    expected = max(0, min(chunk, rows - start))
    if local.shape[0] != expected:
        raise ValueError(f"unexpected FSDP2 shard: {local.shape[0]} rows, expected {expected} of {rows}")
    return start * math.prod(param.shape[1:])


def fsdp2_units(model: torch.nn.Module) -> list[ShardUnit]:
    """One :class:`ShardUnit` per parameter of a ``fully_shard``-ed model (every parameter, in ``named_parameters``
    order: the one-process tensor index)."""
    from torch.distributed.tensor import DTensor

    units = []
    for index, (name, param) in enumerate(model.named_parameters()):
        if not isinstance(param, DTensor):
            raise ValueError(f"Fair Cast over FSDP2: parameter '{name}' is not sharded (a DTensor); wrap every "
                             "module that owns parameters with fully_shard.")
        local = param.to_local()
        units.append(ShardUnit(name, local, _shard0_offset(param, local), index, param.numel(),
                               trainable=param.requires_grad))
    return units


# -- checkpoints ---------------------------------------------------------------------------------------------
def shard_state_file(rank: int) -> str:
    """The file of rank ``rank``'s Fair Cast state in a checkpoint folder (one per rank: each holds its shards)."""
    return f"{STATE_PREFIX}.rank{int(rank)}.pt"


def sharded_state_dict(served: ServedCopy, rank: int, world_size: int) -> dict:
    """``served.state_dict()`` plus the layout of its shards, so another world size can re-shard it."""
    state = served.state_dict()
    state["sharded"] = {"rank": int(rank), "world_size": int(world_size),
                        "layout": {n: (u.index, u.offset, u.master.numel(), u.full_numel)
                                   for n, u in served.units.items()}}
    return state


def save_sharded_state(served: ServedCopy, folder: str, rank: int, world_size: int) -> str:
    path = os.path.join(folder, shard_state_file(rank))
    tmp = path + ".tmp"
    torch.save(sharded_state_dict(served, rank, world_size), tmp)
    os.replace(tmp, path)
    return path


def load_sharded_state(served: ServedCopy, folder: str, rank: int, world_size: int) -> None:
    """Restore this rank's shards from a checkpoint folder: its own file when the checkpoint was written with this
    world size and layout (exact), else every rank's file, re-sharded by global element index."""
    own = os.path.join(folder, shard_state_file(rank))
    first = own if os.path.isfile(own) else os.path.join(folder, shard_state_file(0))  # more ranks than saved
    if not os.path.isfile(first):
        raise ValueError(f"Fair Cast: {folder} has no {shard_state_file(rank)} (nor {shard_state_file(0)}); it was "
                         "not written by a sharded Fair Cast run.")
    state = torch.load(first, map_location="cpu", weights_only=True)
    saved = state.get("sharded") or {}
    mine = {n: (u.index, u.offset, u.master.numel(), u.full_numel) for n, u in served.units.items()}
    same = saved.get("world_size") == world_size and first == own
    if same and {n: tuple(v) for n, v in saved.get("layout", {}).items()} == mine:
        served.load_state_dict(state)
        return
    states = []
    for r in range(int(saved.get("world_size", 0))):
        path = os.path.join(folder, shard_state_file(r))
        if not os.path.isfile(path):
            raise ValueError(f"Fair Cast: re-sharding {folder} (written by {saved.get('world_size')} processes) needs "
                             f"every rank's file; {shard_state_file(r)} is missing.")
        states.append(torch.load(path, map_location="cpu", weights_only=True))
    reshard(served, states)


@torch.no_grad()
def reshard(served: ServedCopy, states: list[dict]) -> None:
    """Fill ``served``'s shards (master, served values, EF residual) from the states of another sharding of the same
    tensors: each element is found by its global index. Raises unless every element is covered exactly once."""
    if not states:
        raise ValueError("Fair Cast: nothing to re-shard from.")
    for key, value in (("mode", served.mode), ("seed", served.seed)):
        found = {s.get(key) for s in states}
        if found != {value}:
            raise ValueError(f"Fair Cast checkpoint has {key}={sorted(map(str, found))}, this run {value!r}.")
    for name, unit in served.units.items():
        offset, numel = unit.offset, unit.master.numel()
        targets = {"master": unit.master.view(-1), "served": served.served[name].view(-1)}
        if served.residual:
            targets["residual"] = served.residual[name].view(-1)
        covered = torch.zeros(numel, dtype=torch.int32)
        for state in states:
            layout = state["sharded"]["layout"]
            if name not in layout:
                raise ValueError(f"Fair Cast checkpoint lacks the state of '{name}'.")
            _, s_offset, s_numel, s_full = layout[name]
            if s_full != unit.full_numel:
                raise ValueError(f"Fair Cast checkpoint: '{name}' has {s_full} elements there, {unit.full_numel} here.")
            lo, hi = max(offset, s_offset), min(offset + numel, s_offset + s_numel)
            if lo >= hi:
                continue
            for key, target in targets.items():
                source = state[key][name].reshape(-1)
                target[lo - offset:hi - offset].copy_(source[lo - s_offset:hi - s_offset])
            covered[lo - offset:hi - offset] += 1
        if numel and not bool((covered == 1).all()):
            raise ValueError(f"Fair Cast checkpoint: the saved shards of '{name}' do not cover it exactly once.")
    served.step = int(states[0]["step"])
