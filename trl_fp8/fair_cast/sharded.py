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


# -- DeepSpeed ZeRO-1/2/3 ---------------------------------------------------------------------------------------
class PartitionUnit(ShardUnit):
    """A run of one tensor's elements inside a DeepSpeed fp32 flat partition. ``master`` *is* DeepSpeed's fp32
    partition (a view: the optimizer steps it); ``apply`` writes the served values into it for the moment DeepSpeed
    copies it to the 16-bit partition (:class:`DeepSpeedExport` puts the master back after the step)."""

    def __init__(self, name: str, fp32_view: torch.Tensor, offset: int, index: int, full_numel: int):
        if fp32_view.dtype != torch.float32:
            raise TypeError(f"Fair Cast needs DeepSpeed's fp32 master partitions, but '{name}' has {fp32_view.dtype}.")
        self.name = name
        self.param = fp32_view
        self.master = fp32_view  # reused, not copied
        self.trainable = True
        self.offset, self.index, self.full_numel = int(offset), int(index), int(full_numel)

    def capture(self) -> None:  # the master is DeepSpeed's own partition
        pass

    def restore(self) -> None:
        pass


def _element_offset(view: torch.Tensor, flat: torch.Tensor) -> int:
    return (view.data_ptr() - flat.data_ptr()) // flat.element_size()


def deepspeed_units(optimizer, module: torch.nn.Module) -> tuple[list[PartitionUnit], list[tuple[int, list[str]]]]:
    """The :class:`PartitionUnit` of every tensor run in this rank's fp32 partitions of a DeepSpeed ZeRO optimizer,
    and per partition group the names it holds. ``module``: the model as DeepSpeed wraps it (``engine.module``), whose
    ``named_parameters`` order is the one-process tensor index."""
    import torch.distributed as dist

    index = {id(p): (n, i) for i, (n, p) in enumerate(module.named_parameters())}
    units, groups = [], []
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: each parameter partitioned on its own
        rank = dist.get_rank(group=getattr(optimizer, "dp_process_group", None))
        for g, params in enumerate(optimizer.fp16_groups):
            flat16, flat32 = optimizer.fp16_partitioned_groups_flat[g], optimizer.fp32_partitioned_groups_flat[g]
            names = []
            for p in params:
                name, i = index[id(p)]
                part = p.ds_tensor
                size = part.ds_numel
                start = rank * size
                valid = max(0, min(size, p.ds_numel - start))
                at = _element_offset(part, flat16)
                if valid:
                    units.append(PartitionUnit(name, flat32.narrow(0, at, valid), start, i, p.ds_numel))
                    names.append(name)
            groups.append((g, names))
        return units, groups
    for g, params in enumerate(optimizer.round_robin_bit16_groups):  # ZeRO-1/2: flat groups cut into partitions
        partition_id = dist.get_rank(group=optimizer.real_dp_process_group[g])
        flat = optimizer.bit16_groups_flat[g]
        size = int(optimizer.partition_size[g])
        lo, hi = partition_id * size, (partition_id + 1) * size
        flat32, names = optimizer.single_partition_of_fp32_groups[g], []
        for p in params:
            name, i = index[id(p)]
            begin = _element_offset(p.data, flat)
            a, b = max(begin, lo), min(begin + p.numel(), hi)
            if a < b:
                units.append(PartitionUnit(name, flat32.narrow(0, a - lo, b - a), a - begin, i, p.numel()))
                names.append(name)
        groups.append((g, names))
    return units, groups


class DeepSpeedExport:
    """Fair Cast in place of DeepSpeed's fp32 -> 16-bit partition copy (ZeRO-1/2/3), reusing its fp32 master.

    On the optimizer instance, ``_optimizer_step(group)`` is wrapped: after DeepSpeed's optimizer has stepped a
    partition, the master is stashed, the export runs (random bits keyed by the global element index, EF residual per
    partition) and the served values are written into the fp32 partition, so DeepSpeed's own copy into its 16-bit
    partition (and its all-gather) is exact. ``step()`` is wrapped to put the master back once DeepSpeed is done. The
    16-bit parameters the forward runs on are then the served copy, bit for bit the one-process export.
    ``resync()`` (after ``load_checkpoint``) writes the restored served values the same way."""

    def __init__(self, optimizer, module: torch.nn.Module, mode: str, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0):
        units, groups = deepspeed_units(optimizer, module)
        self.optimizer = optimizer
        self.copy = ServedCopy(units, mode, dtype, seed) if units else None
        self.groups = dict(groups)
        self.zero3 = hasattr(optimizer, "fp32_partitioned_groups_flat")
        self.step_count = 0
        self._stash: dict[int, torch.Tensor] = {}
        self._optimizer_step = optimizer._optimizer_step
        self._step = optimizer.step
        optimizer._optimizer_step = self._wrapped_optimizer_step
        optimizer.step = self._wrapped_step

    def _flat32(self, group: int) -> torch.Tensor:
        if self.zero3:
            return self.optimizer.fp32_partitioned_groups_flat[group]
        return self.optimizer.single_partition_of_fp32_groups[group]

    @torch.no_grad()
    def _serve(self, group: int, export_step: int | None) -> None:
        names = self.groups.get(group, [])
        if self.copy is None or not names:
            return
        self._stash[group] = self._flat32(group).detach().clone()
        if export_step is not None:
            self.copy.export(export_step, names)
        for name in names:
            self.copy.units[name].apply(self.copy.served[name])  # exact: served values are fp32 values

    def _wrapped_optimizer_step(self, group, *args, **kwargs):
        out = self._optimizer_step(group, *args, **kwargs)
        self._serve(group, self.step_count + 1)
        return out

    @torch.no_grad()
    def _put_back(self) -> None:
        for group, master in self._stash.items():
            self._flat32(group).copy_(master)
        self._stash.clear()

    def _wrapped_step(self, *args, **kwargs):
        try:
            out = self._step(*args, **kwargs)
        finally:
            self._put_back()
        if not getattr(self.optimizer, "overflow", False):  # an overflow-skipped step exports nothing
            self.step_count += 1
            if self.copy is not None:
                self.copy.step = self.step_count
        return out

    @torch.no_grad()
    def resync(self) -> None:
        """Make DeepSpeed's 16-bit weights the served copy again (after ``load_checkpoint``, which re-derives them from
        the fp32 master by round-to-nearest): the served values go through DeepSpeed's own copy and all-gather."""
        if self.copy is not None:
            self.step_count = self.copy.step
        for group in self.groups:
            self._serve(group, None)
        try:
            if self.zero3:  # as in DeepSpeed's step: release the gathered parameters, write the partitions, re-gather
                self.optimizer._partition_all_parameters()
                for group in self.groups:
                    self.optimizer._reassign_or_swap_out_partitioned_parameters(group)
                persistent = getattr(self.optimizer, "persistent_parameters", None)
                if persistent:  # small parameters ZeRO-3 keeps whole on every rank: re-gathered as after a step
                    persistent[0].all_gather(persistent)
                if hasattr(self.optimizer, "invalidate_secondary_tensor"):
                    self.optimizer.invalidate_secondary_tensor()
            else:
                self.optimizer.update_lp_params()
        finally:
            self._put_back()
