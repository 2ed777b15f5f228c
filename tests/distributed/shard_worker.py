"""One rank of the shard-invariance tests (``torchrun --nproc_per_node 2 shard_worker.py OUT ENGINES MODES``, e.g.
``fsdp2`` or ``zero1,zero2,zero3`` and ``stochastic,error_feedback``):
a tiny model trained 4 steps under ``fully_shard`` (FSDP2) or ``deepspeed.initialize`` (ZeRO-2/3, bf16) on CPU with
gloo, Fair Cast exporting over the shards. After every step rank 0 checks that the served copy assembled from the
shards (what the engine's all-gather gives the forward) equals, bit for bit, the one-process export of the
assembled fp32 master (a ServedCopy over whole tensors, fed the same masters). Steps 3-4 run a second time from a
checkpoint of step 2 (each rank's state file, a fresh export object) and must serve the same bits. Writes
``OUT/<engine>-<mode>.rank<r>.json``. DeepSpeed runs with ``DS_ACCELERATOR=cpu``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from trl_fp8.fair_cast.served import ParamUnit, ServedCopy
from trl_fp8.fair_cast import sharded

SEED = 21
STEPS = 4
DEVICE = os.environ.get("SHARD_DEVICE", "cpu")  # "cuda": NCCL, the model and the engines on the GPU (device check)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(13, 6)
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 13, bias=False)

    def forward(self, ids):
        return self.down(torch.tanh(self.up(self.embed(ids))))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 13, (4, 5), generator=g)
    return ids.to(DEVICE), torch.roll(ids, 1, dims=1).to(DEVICE)


def loss_of(model, ids, target):
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 13), target.reshape(-1))


def gather_pieces(copy):
    """Every rank's (name, offset, master piece, served piece), on every rank."""
    mine = [(n, u.offset, u.master.detach().reshape(-1).cpu().clone(),
             copy.served[n].reshape(-1).view(torch.int16).cpu().clone()) for n, u in copy.units.items()]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [p for part in out for p in part]


def assemble(pieces, shapes):
    master = {n: torch.zeros(s).reshape(-1) for n, s in shapes.items()}
    served = {n: torch.zeros(s, dtype=torch.int16).reshape(-1) for n, s in shapes.items()}
    for name, offset, m, q in pieces:
        master[name][offset:offset + m.numel()] = m
        served[name][offset:offset + q.numel()] = q
    return master, served


class Reference:
    """The one-process export of the assembled masters (whole tensors, ParamUnits), in named_parameters order."""

    def __init__(self, shapes, mode, master):
        self.params = {n: torch.nn.Parameter(master[n].clone().view(s)) for n, s in shapes.items()}
        self.copy = ServedCopy([ParamUnit(n, p) for n, p in self.params.items()], mode, torch.bfloat16, seed=SEED)
        self.copy.begin(0)

    def step(self, step, master):
        with torch.no_grad():
            for n, p in self.params.items():
                p.data.copy_(master[n].view(p.shape))
        self.copy.after_step(step)
        return {n: t.reshape(-1).view(torch.int16) for n, t in self.copy.served.items()}


# -- engines ------------------------------------------------------------------------------------------------------
def fsdp2_setup(mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny().to(DEVICE)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    policy = {}
    if DEVICE == "cuda":  # the all-gather in the served dtype: exact, since the shards hold served values
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    for module in (model.embed, model.up, model.down):
        fully_shard(module, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run = Run(shapes)
    run.copy = ServedCopy(sharded.fsdp2_units(model), mode, torch.bfloat16, seed=SEED)
    run.copy.begin(0)

    def train_step(step):
        ids, target = batch(step, dist.get_rank())
        loss_of(model, ids, target).backward()
        run.copy.before_step()
        optimizer.step()
        optimizer.zero_grad()
        run.copy.after_step(step)

    def forward_view():  # what the engine's all-gather hands the forward: the full parameters
        return {n: p.full_tensor().detach().to(torch.bfloat16).reshape(-1).view(torch.int16).cpu()
                for n, p in model.named_parameters()}

    def restart(folder):  # a fresh export object, restored from the checkpoint (the engine keeps its own state)
        run.copy = ServedCopy(sharded.fsdp2_units(model), mode, torch.bfloat16, seed=SEED)
        sharded.load_sharded_state(run.copy, folder, dist.get_rank(), dist.get_world_size())
        run.copy.begin(2, restored=True)

    run.train_step, run.forward_view, run.restart = train_step, forward_view, restart
    return run


class Run:
    def __init__(self, shapes):
        self.shapes = shapes
        self.copy = self.train_step = self.forward_view = self.restart = self.save = None


def deepspeed_setup(stage):
    def setup(mode):
        import deepspeed

        torch.manual_seed(0)
        model = Tiny()
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        run = Run(shapes)
        run.copy = sharded.DeepSpeedExport(optimizer, engine.module, mode, torch.bfloat16, seed=SEED).copy
        run.export = None

        def train_step(step):
            ids, target = batch(step, dist.get_rank())
            engine.backward(loss_of(engine, ids, target))
            engine.step()

        def forward_view():
            params = list(engine.module.parameters())
            if stage == 3:
                with deepspeed.zero.GatheredParameters(params):
                    return {n: p.detach().to(torch.bfloat16).reshape(-1).view(torch.int16).cpu().clone()
                            for n, p in engine.module.named_parameters()}
            return {n: p.detach().reshape(-1).view(torch.int16).cpu().clone()
                    for n, p in engine.module.named_parameters()}

        def restart(folder):  # a fresh engine from DeepSpeed's checkpoint, a fresh export from ours
            nonlocal engine, optimizer
            torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
            fresh = Tiny()
            engine, optimizer, _, _ = deepspeed.initialize(model=fresh, config=config,
                                                           model_parameters=fresh.parameters())
            engine.load_checkpoint(folder, tag="step2")
            export = sharded.DeepSpeedExport(optimizer, engine.module, mode, torch.bfloat16, seed=SEED)
            sharded.load_sharded_state(export.copy, folder, dist.get_rank(), dist.get_world_size())
            export.resync()
            run.copy = export.copy

        def save(folder):
            engine.save_checkpoint(folder, tag="step2")

        run.train_step, run.forward_view, run.restart, run.save = train_step, forward_view, restart, save
        return run

    return setup


def run(out, engine, mode):
    rank, world = dist.get_rank(), dist.get_world_size()
    setup = {"fsdp2": fsdp2_setup, "zero1": deepspeed_setup(1), "zero2": deepspeed_setup(2),
             "zero3": deepspeed_setup(3)}[engine]
    record = {"rank": rank, "world": world, "steps": [], "errors": []}
    served_by_run = {}
    for attempt in ("straight", "resumed"):
        r = setup(mode)
        shapes, reference, digests = r.shapes, None, []
        for step in range(1, STEPS + 1):
            if attempt == "resumed" and step == 3:
                folder = os.path.join(out, f"{engine}-{mode}-ckpt")
                os.makedirs(folder, exist_ok=True)
                if r.save is not None:
                    r.save(folder)
                sharded.save_sharded_state(r.copy, folder, rank, world)
                dist.barrier()
                r.restart(folder)
            if step == 1:  # the reference starts from the assembled initial masters
                master, _ = assemble(gather_pieces(r.copy), shapes)
                reference = Reference(shapes, mode, master)
            r.train_step(step)
            master, served = assemble(gather_pieces(r.copy), shapes)
            expected = reference.step(step, master)
            view = r.forward_view()
            for name in shapes:
                if not torch.equal(served[name], expected[name]):
                    record["errors"].append(f"{attempt} step {step} {name}: shards' export != one-process export")
                if not torch.equal(view[name], expected[name]):
                    record["errors"].append(f"{attempt} step {step} {name}: the forward's weights != the export")
            digests.append(hash(tuple(tuple(served[n].tolist()) for n in sorted(served))))
        served_by_run[attempt] = digests
    record["straight"], record["resumed"] = served_by_run["straight"], served_by_run["resumed"]
    with open(os.path.join(out, f"{engine}-{mode}.rank{rank}.json"), "w") as f:
        json.dump(record, f)


def main():
    out, engines, modes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    try:
        for engine in engines:
            for mode in modes:
                run(out, engine, mode)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
