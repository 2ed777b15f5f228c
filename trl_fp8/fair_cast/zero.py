"""Fair Cast in the trainer under DeepSpeed ZeRO (1/2: parameters whole on every rank; 3: partitioned too).

DeepSpeed owns the fp32 master (its optimizer partitions) and the 16-bit weights the forward runs on. At the start of
training (after accelerate has built the engine and loaded a checkpoint) :class:`ZeroFairCast` installs
:class:`~trl_fp8.fair_cast.sharded.DeepSpeedExport` on the engine's optimizer: from then on every optimizer step
writes the export into DeepSpeed's 16-bit partitions, which DeepSpeed all-gathers, so the module's 16-bit weights
*are* the served copy on every rank — the loss runs on them (Fair Cast's "loss on the served copy" for free), and the
in-process twin is synced from them (under ZeRO-3 gathered one tensor at a time; the twin itself is built at set-up
from the gathered weights, :func:`gathered_twin`).

SR and RTN resume exactly by exporting DeepSpeed's restored master again at the resumed step (the random bits are
keyed by (seed, step, tensor, global element)). Error feedback's residual lives per ZeRO partition: at each save every
rank writes its own ``fair_cast_state.rank<r>.pt`` (served values, residual and their global layout) into the
checkpoint next to DeepSpeed's per-rank files, and a resume reads it back from the checkpoint passed in, wherever it
lies now (re-sharded by global element index if the world size changed) — or refuses, naming the file, when it is
not there. Metrics come from each rank's partitions and are reduced once over the ranks.
"""

from __future__ import annotations

import os

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import distributed
from .sharded import DeepSpeedExport, load_sharded_state, save_sharded_state, shard_state_file


class ZeroFairCast(TrainerCallback):
    def __init__(self, trainer, mode: str, dtype: torch.dtype, seed: int, record):
        self.trainer = trainer
        self.mode, self.dtype, self.seed = mode, dtype, seed
        self.record = record
        self.export: DeepSpeedExport | None = None
        self.module = None
        self.restored_step: int | None = None
        self.rank_folder: str | None = None  # the checkpoint being resumed (its per-rank files)
        self.zero3 = False

    @property
    def active(self) -> bool:
        return self.export is not None

    def stream(self):
        """The served copy: the module's 16-bit weights (whole on every rank under ZeRO-1/2; under ZeRO-3 gathered one
        tensor at a time — a collective: every rank iterates the whole stream, as TRL's ZeRO-3 sync does)."""
        if not self.zero3:
            return ((n, p.detach().to(self.dtype)) for n, p in self.module.named_parameters())
        return self._gathered()

    def _gathered(self):
        import deepspeed

        for name, param in self.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                tensor = param.detach().to(self.dtype).clone()
            yield name, tensor

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        optimizer = getattr(engine, "optimizer", None)
        self.zero3 = hasattr(optimizer, "fp32_partitioned_groups_flat")
        if optimizer is None or not (self.zero3 or hasattr(optimizer, "single_partition_of_fp32_groups")):
            raise ValueError("Fair Cast under DeepSpeed expects a ZeRO optimizer on the engine, found "
                             f"{type(optimizer).__name__}.")
        self.module = engine.module
        weights = {p.dtype for p in self.module.parameters()}
        if weights - {self.dtype, torch.float32}:
            raise ValueError(f"Fair Cast serves {self.dtype} weights, but DeepSpeed computes in "
                             f"{sorted(map(str, weights))}: set served_dtype to DeepSpeed's 16-bit dtype (bf16=True -> "
                             "'bfloat16', fp16=True -> 'float16').")
        if self.export is None:
            self.export = DeepSpeedExport(optimizer, self.module, self.mode, self.dtype, self.seed)
        if self.restored_step is not None or state.global_step:
            step = self.restored_step if self.restored_step is not None else state.global_step
            self.export.step_count = step
            if self.mode == "error_feedback":
                self._load_rank_state(args, step)
            else:
                self._export_again(step)

    def _checkpoint_folder(self, args, step: int) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")

    def _load_rank_state(self, args, step: int) -> None:
        """EF: this rank's served values and residual from its own file (re-sharded from every rank's when the world
        size changed), then DeepSpeed's 16-bit weights are made the served copy again. The files are read from the
        checkpoint being resumed (:meth:`FairCast.load_process_files`), wherever it lies now."""
        name = shard_state_file(distributed.rank())
        candidates = [self.rank_folder or self._checkpoint_folder(args, step)]
        folder = next((f for f in candidates if os.path.isfile(os.path.join(f, name))
                       or os.path.isfile(os.path.join(f, shard_state_file(0)))), None)
        if folder is None:
            raise ValueError(f"Resuming Fair Cast error feedback under DeepSpeed needs each rank's {name} (written "
                             f"beside DeepSpeed's own per-rank files at each save); looked in {', '.join(candidates)}. "
                             "Resume from the checkpoint folder the run wrote, or use fair_cast='stochastic'.")
        load_sharded_state(self.export.copy, folder, distributed.rank(), distributed.world_size())
        self.export.copy.step = step
        self.export.resync()

    def save_rank_state(self, folder: str) -> None:
        """EF: this rank's partitions' Fair Cast state (served values and residual) into the checkpoint being staged,
        before its completion marker (called by every process from :func:`trl_fp8.checkpoints.save_checkpoint`)."""
        if self.export is None or self.export.copy is None or self.mode != "error_feedback":
            return
        os.makedirs(folder, exist_ok=True)
        save_sharded_state(self.export.copy, folder, distributed.rank(), distributed.world_size())

    @torch.no_grad()
    def _export_again(self, step: int) -> None:
        """SR/RTN: the export of DeepSpeed's restored master at ``step`` is the served copy the run had."""
        export = self.export
        if export.copy is not None:
            export.copy.export(step)
            export.copy.step = step
        export.resync()

    def on_optimizer_step(self, args, state, control, **kwargs):
        copy = self.export.copy if self.export is not None else None
        metrics = copy.metrics() if copy is not None else {}
        keys = ("visible_update_frac", "lag_steps", "max_abs_err_ulps")
        present = [1.0 if k in metrics else 0.0 for k in keys]
        values = [metrics.get(k, 0.0) for k in keys]
        # every rank holds other partitions: the fraction and lag are averaged, the error is the max (once)
        reduced = distributed.reduce_floats(values + present, ["sum", "sum", "max", "sum", "sum", "max"],
                                            self.trainer.accelerator.device)
        for i, key in enumerate(keys):
            count = reduced[len(keys) + i]
            if count:
                self.record(f"fair_cast/{key}", reduced[i] if key == "max_abs_err_ulps" else reduced[i] / count)


@torch.no_grad()
def gathered_twin(trainer, model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The in-process sampler under ZeRO-3: a plain (not partitioned) instance of the policy's class holding the
    gathered weights in ``dtype`` — what DeepSpeed's own 16-bit copy starts from — with TRL's fused head patch."""
    import deepspeed

    from .. import _trl

    with torch.device("meta"):  # no allocation, no random init: every tensor is taken from the policy below
        twin = type(model)(model.config)
    mine = dict(twin.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    if set(mine) != set(names):
        raise ValueError("Fair Cast could not rebuild the policy for its sampler under ZeRO-3: parameters only in the "
                         f"policy {sorted(set(names) - set(mine))[:5]}, only in the rebuilt model "
                         f"{sorted(set(mine) - set(names))[:5]}.")
    made: dict[int, torch.nn.Parameter] = {}  # tied weights stay one tensor
    for name, param in model.named_parameters(remove_duplicate=False):  # one tensor gathered at a time
        if id(param) not in made:
            with deepspeed.zero.GatheredParameters([param]):
                made[id(param)] = torch.nn.Parameter(param.detach().to(dtype).clone(), requires_grad=False)
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._parameters[leaf] = made[id(param)]
    for name, buffer in model.named_buffers(remove_duplicate=False):  # not partitioned (rotary frequencies, ...)
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._buffers[leaf] = buffer.detach().clone()
    left = [n for n, t in list(twin.named_parameters()) + list(twin.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"Fair Cast could not rebuild the policy for its sampler under ZeRO-3: {left[:5]} have no "
                         "counterpart in the policy.")
    _trl.patch_fused_head(trainer, model, twin)
    return twin.eval()
