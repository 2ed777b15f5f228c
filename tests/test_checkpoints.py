"""trl_fp8.checkpoints: atomic checkpoints, what counts as complete, rotation, and resume_from_checkpoint='auto'/True.

The kill -9 matrix (tests/checkpoints/) proves the whole story end to end; these are the rules, one by one."""

import json
import logging
import os
import shutil

import pytest
import torch

import trl_fp8
from trl_fp8 import checkpoints as ck
from trl_fp8.checkpoints import durable
from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset


# -- folders built by hand ----------------------------------------------------------------------------------------
def _legacy(path, step, files=("config.json", "model.safetensors", "optimizer.pt", "trainer_state.json")):
    """A checkpoint folder as plain TRL/transformers writes it (no marker)."""
    os.makedirs(path, exist_ok=True)
    for name in files:
        with open(os.path.join(path, name), "w") as f:
            f.write(json.dumps({"global_step": step}) if name == "trainer_state.json" else "x" * 10)
    return str(path)


def _marked(run_dir, step, payload="weights"):
    tmp = os.path.join(run_dir, f"_tmp-checkpoint-{step}")
    os.makedirs(os.path.join(tmp, "sub"))
    with open(os.path.join(tmp, "model.safetensors"), "w") as f:
        f.write(payload)
    with open(os.path.join(tmp, "sub", "adapter.bin"), "w") as f:
        f.write("a")
    final = os.path.join(run_dir, f"checkpoint-{step}")
    ck.commit(tmp, final)
    return final


def test_commit_writes_the_marker_last_and_renames_into_place(tmp_path):
    final = _marked(tmp_path, 3)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]
    with open(os.path.join(final, ck.MARKER)) as f:
        marker = json.load(f)
    assert marker["global_step"] == 3 and marker["files"] == {"model.safetensors": 7, "sub/adapter.bin": 1}
    assert ck.check_complete(final) == ck.Verdict(True, "completion marker", marked=True)
    # saving the same step again replaces the folder, leaving nothing aside
    again = _marked(tmp_path, 3, payload="new weights")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]
    with open(os.path.join(again, "model.safetensors")) as f:
        assert f.read() == "new weights"


def test_a_marked_folder_with_a_missing_or_cut_file_is_incomplete(tmp_path):
    final = _marked(tmp_path, 2)
    with open(os.path.join(final, "model.safetensors"), "w") as f:
        f.write("cut")
    assert ck.check_complete(final).reason == "model.safetensors has 3 bytes, 7 were written"
    os.remove(os.path.join(final, "sub", "adapter.bin"))
    assert not ck.check_complete(final).complete
    with open(os.path.join(final, ck.MARKER), "w") as f:
        f.write('{"files": ')
    assert "unreadable" in ck.check_complete(final).reason


def test_folders_without_a_marker_judged_by_trainer_state_and_weights(tmp_path):
    assert ck.check_complete(_legacy(tmp_path / "checkpoint-4", 4)).complete
    half = _legacy(tmp_path / "checkpoint-9", 9, files=("config.json",))  # the kill -9 the issue reports
    assert ck.check_complete(half) == ck.Verdict(False, "no trainer_state.json (it was being written when the run "
                                                        "stopped)")
    assert "for step 3" in ck.check_complete(_legacy(tmp_path / "checkpoint-5", 3)).reason
    assert "no model" in ck.check_complete(_legacy(tmp_path / "checkpoint-6", 6, files=("trainer_state.json",))).reason
    broken = _legacy(tmp_path / "checkpoint-7", 7)
    with open(os.path.join(broken, "trainer_state.json"), "w") as f:
        f.write("{")
    assert "unreadable" in ck.check_complete(broken).reason
    assert not ck.check_complete(tmp_path / "absent").complete


def test_clean_stale_removes_leftovers_and_completes_an_interrupted_rename(tmp_path):
    run = str(tmp_path)
    done = _marked(run, 7)
    os.rename(done, os.path.join(run, "_tmp-checkpoint-7"))  # killed between the marker and the rename
    os.makedirs(os.path.join(run, "_tmp-checkpoint-8"))  # killed while writing
    _legacy(os.path.join(run, "_tmp-checkpoint-9"), 9)  # every file written, killed before the marker
    _marked(run, 3)
    os.makedirs(os.path.join(run, "_tmp-checkpoint-3"))  # a second save of step 3 killed early
    os.makedirs(os.path.join(run, "_tmp-deleting-checkpoint-1"))  # killed during rotation
    os.makedirs(os.path.join(run, "checkpoint-5"))  # a user's (or plain TRL's) folder: left alone
    lines = ck.clean_stale(run)
    assert sorted(os.listdir(run)) == ["checkpoint-3", "checkpoint-5", "checkpoint-7"]
    assert "completed the interrupted save of checkpoint-7" in lines and len(lines) == 5
    assert ck.check_complete(os.path.join(run, "checkpoint-7")).complete
    assert ck.clean_stale(str(tmp_path / "absent")) == []


def test_rotation_counts_complete_checkpoints_and_never_removes_the_newest(tmp_path):
    run = str(tmp_path)
    for step in (1, 2, 3):
        _marked(run, step)
    half = _legacy(tmp_path / "checkpoint-9", 9, files=("config.json",))
    removed = ck.rotate(run, 2, None, os.path.join(run, "checkpoint-3"))
    assert removed == [os.path.join(run, "checkpoint-1")]
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-3", "checkpoint-9"]  # the incomplete one is ignored
    # limit 1 with a protected best checkpoint: both stay
    assert ck.rotate(run, 1, os.path.join(run, "checkpoint-2"), os.path.join(run, "checkpoint-3")) == []
    # the checkpoint just written is kept even when mtimes would rank it first
    os.utime(os.path.join(run, "checkpoint-3"), (1, 1))
    assert ck.rotate(run, 1, None, os.path.join(run, "checkpoint-3")) == [os.path.join(run, "checkpoint-2")]
    assert sorted(os.listdir(run)) == ["checkpoint-3", "checkpoint-9"] and os.path.isdir(half)
    assert ck.rotate(run, None, None, "x") == [] and ck.rotate(run, 0, None, "x") == []


def test_remove_checkpoint_renames_aside_first(tmp_path, monkeypatch):
    final = _marked(tmp_path, 4)
    seen = []
    monkeypatch.setattr(durable.shutil, "rmtree", lambda path, **kw: seen.append(os.path.basename(path)))
    ck.remove_checkpoint(final)
    assert seen == ["_tmp-deleting-checkpoint-4"] and not os.path.exists(final)


# -- settings a resume must match ---------------------------------------------------------------------------------
def _config(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    kwargs.update(overrides)
    return trl_fp8.GRPOConfig(**kwargs)


@pytest.mark.parametrize("saved, now, field", [
    (dict(fair_cast="stochastic"), dict(fair_cast="error_feedback"), "fair_cast"),
    (dict(fair_cast="stochastic"), dict(fair_cast="off"), "fair_cast"),
    (dict(fair_cast="stochastic"), dict(fair_cast="stochastic", served_dtype="float16", bf16=False), "served_dtype"),
    (dict(mxfp8=True), dict(), "mxfp8"),
    (dict(duet=True, duet_budget=0.5), dict(duet=True, duet_budget=0.3), "duet_budget"),
    (dict(fast_qlora="on"), dict(fast_qlora="off"), "fast_qlora"),
    (dict(fast_qlora="on"), dict(fast_qlora="on", qlora_keep_budget_gb=0.0), "qlora_keep_budget_gb"),
])
def test_settings_that_shape_the_state_must_match(tmp_path, saved, now, field):
    saved_fields = ck.settings_of(_config(tmp_path, **saved))
    differences = ck.settings_differences(saved_fields, _config(tmp_path, **now))
    assert len(differences) == 1 and differences[0].startswith(f"{field}="), differences


def test_settings_that_do_not_shape_the_state_may_change(tmp_path):
    saved = ck.settings_of(_config(tmp_path, fair_cast="stochastic", duet=True))
    # the checks, the rollout cache, the MXFP8 kernel, Fair Cast's seed, settings of capabilities that are off
    now = _config(tmp_path, fair_cast="stochastic", duet=True, sync_checks="off", fair_cast_seed=5,
                  qlora_rollout_cache_gb=0.0, mxfp8_kernel="emulated", mxfp8_exclude=["lm_head"])
    assert ck.settings_differences(saved, now) == []
    # a field the checkpoint has no record of is compared with its default
    del saved["duet_budget"]
    assert ck.settings_differences(saved, _config(tmp_path, fair_cast="stochastic", duet=True)) == []
    assert ck.settings_differences(saved, _config(tmp_path, fair_cast="stochastic", duet=True, duet_budget=0.9))


# -- the trainer ----------------------------------------------------------------------------------------------------
def _length_reward(completions, **kwargs):  # varies between rollouts: the model does learn
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) / 10 for c in completions]


def _trainer(tmp_path, model_dir, name="run", **overrides):
    kwargs = dict(output_dir=str(tmp_path / name), use_cpu=True, bf16=False, max_steps=3, learning_rate=5e-3,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=6, logging_steps=1,
                  save_strategy="steps", save_steps=1, report_to="none", disable_tqdm=True, seed=7,
                  gradient_checkpointing=False)
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[_length_reward], args=trl_fp8.GRPOConfig(**kwargs),
                               train_dataset=make_arithmetic_dataset(64, seed=5))


def test_a_checkpoint_is_complete_marked_and_holds_the_settings(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir, max_steps=2, duet=True, save_total_limit=1)
    trainer.train()
    run = trainer.args.output_dir
    assert sorted(n for n in os.listdir(run) if "checkpoint" in n) == ["checkpoint-2"]  # rotated, nothing stale
    folder = os.path.join(run, "checkpoint-2")
    with open(os.path.join(folder, ck.MARKER)) as f:
        listed = json.load(f)["files"]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                 "duet_state.pt", ck.SETTINGS):
        assert name in listed, name
    assert set(listed) == {n for n in os.listdir(folder) if n != ck.MARKER}
    with open(os.path.join(folder, ck.SETTINGS)) as f:
        settings = json.load(f)
    # DUET, and the Fair Cast probe (on while Fair Cast is off: it keeps no state)
    assert settings["capabilities"] == ["duet", "fair_cast_probe"] and settings["fields"]["duet_budget"] == 0.5
    with open(os.path.join(folder, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 2


def test_auto_and_true_skip_a_half_written_checkpoint(tmp_path, tiny_model_dir, caplog):
    first = _trainer(tmp_path, tiny_model_dir, max_steps=2)
    first.train()
    run = first.args.output_dir
    _legacy(os.path.join(run, "checkpoint-9"), 9, files=("config.json",))  # a kill -9 during plain TRL's save
    for value in ("auto", True):
        trainer = _trainer(tmp_path, tiny_model_dir, max_steps=3)
        with caplog.at_level(logging.WARNING, logger="trl_fp8.checkpoints"):
            caplog.clear()
            trainer.train(resume_from_checkpoint=value)
        assert "skipping checkpoint-9 (no trainer_state.json" in caplog.text
        assert "resuming from checkpoint-2" in caplog.text
        assert trainer.state.global_step == 3
        os.remove(os.path.join(run, "checkpoint-3", ck.MARKER))  # so that the next round resumes from 2 again
        ck.remove_checkpoint(os.path.join(run, "checkpoint-3"))
    with pytest.raises(ValueError, match="not a complete checkpoint .no trainer_state.json"):
        _trainer(tmp_path, tiny_model_dir).train(resume_from_checkpoint=os.path.join(run, "checkpoint-9"))


def test_auto_starts_fresh_where_true_refuses(tmp_path, tiny_model_dir, caplog):
    run = tmp_path / "run"
    _legacy(run / "checkpoint-1", 1, files=("config.json",))
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory .* \(skipped: checkpoint-1"):
        _trainer(tmp_path, tiny_model_dir, max_steps=1).train(resume_from_checkpoint=True)
    trainer = _trainer(tmp_path, tiny_model_dir, max_steps=1, resume_from_checkpoint="auto")
    with caplog.at_level(logging.WARNING, logger="trl_fp8.checkpoints"):
        trainer.train()  # args.resume_from_checkpoint='auto' is honoured without an argument
    assert "no complete checkpoint" in caplog.text and "starting fresh" in caplog.text
    assert trainer.state.global_step == 1
    # an output_dir that does not exist yet: the first session of a 'Run all' notebook
    fresh = _trainer(tmp_path, tiny_model_dir, name="new", max_steps=1)
    fresh.train(resume_from_checkpoint="auto")
    assert fresh.state.global_step == 1


def test_a_checkpoint_with_other_settings_is_refused_naming_the_field(tmp_path, tiny_model_dir):
    _trainer(tmp_path, tiny_model_dir, max_steps=1, duet=True).train()
    with pytest.raises(ValueError, match=r"duet_budget=0.5 in the checkpoint, duet_budget=0.25 in this run"):
        _trainer(tmp_path, tiny_model_dir, max_steps=2, duet=True, duet_budget=0.25).train(
            resume_from_checkpoint="auto")


def test_resume_between_two_generations_is_exact(tmp_path, tiny_model_dir):
    """steps_per_generation=2: checkpoint-1 falls between two generations; it holds TRL's generation buffer, so the
    resumed run trains step 2 on the same batch (TRL alone would generate a new one)."""
    common = dict(max_steps=3, steps_per_generation=2)
    straight = _trainer(tmp_path, tiny_model_dir, **common)
    straight.train()
    checkpoint = os.path.join(straight.args.output_dir, "checkpoint-1")
    assert os.path.isfile(os.path.join(checkpoint, ck.GENERATION_STATE))
    assert not os.path.isfile(os.path.join(straight.args.output_dir, "checkpoint-2", ck.GENERATION_STATE))
    resumed = _trainer(tmp_path, tiny_model_dir, name="resumed", **common)
    resumed.train(resume_from_checkpoint=checkpoint)
    for (n, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n
    # without the buffer (TRL's own resume) step 2 trains on a fresh generation: not the run it would have been
    os.remove(os.path.join(checkpoint, ck.GENERATION_STATE))
    os.remove(os.path.join(checkpoint, ck.MARKER))
    regenerated = _trainer(tmp_path, tiny_model_dir, name="regenerated", **common)
    regenerated.train(resume_from_checkpoint=checkpoint)
    assert any(not torch.equal(p, q) for p, q in zip(straight.model.parameters(), regenerated.model.parameters()))


def test_starting_a_finished_run_again_trains_nothing(tmp_path, tiny_model_dir, caplog):
    """'Run all' once more after the run finished: transformers alone would train a step past max_steps."""
    done = _trainer(tmp_path, tiny_model_dir, max_steps=2, fair_cast="stochastic")
    done.train()
    again = _trainer(tmp_path, tiny_model_dir, max_steps=2, fair_cast="stochastic")
    with caplog.at_level(logging.WARNING, logger="trl_fp8.checkpoints"):
        out = again.train(resume_from_checkpoint="auto")
    assert "training is complete, nothing to train" in caplog.text
    assert out.global_step == again.state.global_step == 2 and len(again.state.log_history) == 2
    assert sorted(n for n in os.listdir(done.args.output_dir) if n.startswith("checkpoint")) == ["checkpoint-1",
                                                                                                  "checkpoint-2"]
    for (n, p), (_, q) in zip(done.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(p, q), n
    a, b = done.capability("fair_cast").served, again.capability("fair_cast").served
    assert all(torch.equal(a.master[n], b.master[n]) for n in a.master)
    # more steps asked for: it trains on from there
    more = _trainer(tmp_path, tiny_model_dir, max_steps=3, fair_cast="stochastic")
    more.train(resume_from_checkpoint="auto")
    assert more.state.global_step == 3


def _as_written_before_atomic_checkpoints(folder, *drop):
    for name in (ck.MARKER, ck.SETTINGS, *drop):
        os.remove(os.path.join(folder, name))


def test_checkpoints_of_earlier_trl_fp8_versions(tmp_path, tiny_model_dir, caplog):
    """Earlier versions wrote fair_cast_state.pt after trainer_state.json (a kill between them left it out) and no
    DUET state at all: 'auto' skips the first, and resumes the second with a fresh DUET controller."""
    fair_cast = _trainer(tmp_path, tiny_model_dir, name="fc", max_steps=2, fair_cast="error_feedback")
    fair_cast.train()
    run = fair_cast.args.output_dir
    _as_written_before_atomic_checkpoints(os.path.join(run, "checkpoint-1"))
    _as_written_before_atomic_checkpoints(os.path.join(run, "checkpoint-2"), "fair_cast_state.pt")
    again = _trainer(tmp_path, tiny_model_dir, name="fc", max_steps=2, fair_cast="error_feedback")
    with caplog.at_level(logging.WARNING, logger="trl_fp8.checkpoints"):
        again.train(resume_from_checkpoint="auto")
    assert ("skipping checkpoint-2 (no fair_cast_state.pt (incomplete, or written without fair_cast)); resuming from "
            "checkpoint-1") in caplog.text
    assert again.state.global_step == 2

    duet = _trainer(tmp_path, tiny_model_dir, name="duet", max_steps=1, duet=True)
    duet.train()
    _as_written_before_atomic_checkpoints(os.path.join(duet.args.output_dir, "checkpoint-1"), "duet_state.pt")
    resumed = _trainer(tmp_path, tiny_model_dir, name="duet", max_steps=2, duet=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_fp8.checkpoints"):
        resumed.train(resume_from_checkpoint="auto")
    assert "has no duet_state.pt; it starts afresh" in caplog.text and resumed.state.global_step == 2


def test_transient_folders_stay_out_of_the_background_hub_upload_of_output_dir():
    from huggingface_hub.utils import filter_repo_objects

    transient = [f"{ck.TMP_PREFIX}checkpoint-4/model.safetensors", f"{ck.TMP_PREFIX}deleting-checkpoint-2/optimizer.pt",
                 f"{ck.TMP_PREFIX}replaced-checkpoint-4/sub/adapter_model.safetensors"]
    # the patterns transformers' _push_from_checkpoint uploads output_dir with (fingerprinted in the contract test)
    assert list(filter_repo_objects([*transient, "README.md"], ignore_patterns=["_*", "checkpoint-*"])) == ["README.md"]


# -- edges: failed fsyncs and deletes, damaged records, another number of processes --------------------------------
def test_a_folder_fsync_that_fails_is_raised_one_the_filesystem_cannot_do_is_skipped(tmp_path, monkeypatch):
    import errno

    def fsync(fd, code):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(durable.os, "fsync", lambda fd: fsync(fd, errno.EIO))
    with pytest.raises(OSError, match=f"fsync of the folder {tmp_path} failed .*may not be on disk"):
        durable.fsync_dir(str(tmp_path))
    monkeypatch.setattr(durable.os, "fsync", lambda fd: fsync(fd, errno.EINVAL))
    durable.fsync_dir(str(tmp_path))  # a filesystem without folder fsync: as before, nothing to do


def test_a_rotation_delete_that_fails_says_so(tmp_path, monkeypatch, caplog):
    for step in (1, 2, 3):
        _marked(tmp_path, step)

    def rmtree(path, onerror=None, onexc=None, **kw):  # a read-only or busy file deep inside
        err = PermissionError(13, "Permission denied")
        if onexc is not None:
            onexc(os.unlink, os.path.join(path, "model.safetensors"), err)
        else:
            onerror(os.unlink, os.path.join(path, "model.safetensors"), (PermissionError, err, None))

    monkeypatch.setattr(durable.shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger="trl_fp8.checkpoints"):
        removed = ck.rotate(str(tmp_path), 1, None, os.path.join(tmp_path, "checkpoint-3"))
    assert len(removed) == 2
    assert "could not remove" in caplog.text and "_tmp-deleting-checkpoint-1" in caplog.text
    assert "Permission denied" in caplog.text and "deleted by hand" in caplog.text


@pytest.mark.parametrize("files", [["model.safetensors"], "model.safetensors", {"model.safetensors": "7"}, None])
def test_a_marker_that_does_not_list_files_with_sizes_means_incomplete(tmp_path, files):
    final = _marked(tmp_path, 5)
    with open(os.path.join(final, ck.MARKER), "w") as f:
        json.dump({"format": 1, "global_step": 5, "files": files}, f)
    verdict = ck.check_complete(final)
    assert not verdict.complete and verdict.marked
    assert "does not list files" in verdict.reason or "unreadable" in verdict.reason
    newest = _marked(tmp_path, 6)
    assert ck.rotate(str(tmp_path), 1, None, newest) == []  # right after a good save: no AttributeError


def _stub_trainer(world_size=1, capabilities=None):
    from types import SimpleNamespace

    return SimpleNamespace(args=SimpleNamespace(world_size=world_size), capabilities=capabilities or {})


def test_an_unreadable_settings_file_is_refused_naming_it(tmp_path):
    folder = _marked(tmp_path, 2)
    with open(os.path.join(folder, ck.SETTINGS), "w") as f:
        f.write('{"fields": {"duet": tr')  # cut mid-write by something other than trl_fp8
    with pytest.raises(ValueError, match=f"Cannot resume from {folder}: its {ck.SETTINGS} is unreadable"):
        ck.check_settings(_stub_trainer(), folder)
    with open(os.path.join(folder, ck.SETTINGS), "w") as f:
        json.dump(["not", "a", "record"], f)
    with pytest.raises(ValueError, match="is not a trl_fp8 settings record"):
        ck.check_settings(_stub_trainer(), folder)


def test_a_resume_between_generations_with_another_number_of_processes_is_refused(tmp_path):
    folder = _marked(tmp_path, 4)
    for rank in (0, 1):
        torch.save({"step": 1}, os.path.join(folder, f"grpo_generation_state_{rank}.pt"))
    with open(os.path.join(folder, ck.SETTINGS), "w") as f:
        json.dump({"format": 1, "world_size": 2, "fields": {}}, f)
    ck.check_world_size(2, folder, 2)  # the same number: fine
    for now in (1, 4):
        with pytest.raises(ValueError, match=rf"with {now} process\(es\): it was saved by 2 between two generations"
                                             r".*grpo_generation_state_0.pt, grpo_generation_state_1.pt"):
            ck.check_settings(_stub_trainer(world_size=now), folder)
    os.remove(os.path.join(folder, ck.SETTINGS))  # written before the world size was recorded: the files tell
    with pytest.raises(ValueError, match="saved by 2 between two generations"):
        ck.check_world_size(None, folder, 1)
    for rank in (0, 1):  # at a generation boundary there is no buffer: any number of processes may resume
        os.remove(os.path.join(folder, f"grpo_generation_state_{rank}.pt"))
    ck.check_world_size(2, folder, 3)


def test_the_settings_record_the_number_of_processes(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir, max_steps=1)
    trainer.train()
    with open(os.path.join(trainer.args.output_dir, "checkpoint-1", ck.SETTINGS)) as f:
        assert json.load(f)["world_size"] == 1


def test_a_state_file_that_does_not_load_names_the_checkpoint_and_the_capability(tmp_path):
    from trl_fp8.capability import Capability

    class Stateful(Capability):
        name = "duet"
        state_file = "duet_state.pt"

    folder = _marked(tmp_path, 3)
    with open(os.path.join(folder, "duet_state.pt"), "wb") as f:
        f.write(b"PK\x03\x04 cut short")
    trainer = _stub_trainer(capabilities={"duet": Stateful.__new__(Stateful)})
    with pytest.raises(ValueError, match=rf"Cannot resume from {folder}: the duet state \(duet_state.pt\) does not "
                                         "load"):
        ck.load_states(trainer, folder)


def test_a_sharded_final_save_over_a_single_file_one_leaves_no_stale_weights(tmp_path, tiny_model_dir):
    """save_final_model into a folder holding an earlier single-file save, now sharded (and back): the other format's
    weight files are removed. Before, the old model.safetensors stayed beside the new shards and transformers,
    which loads the single file first, loaded the old weights. (Checkpoints cannot mix formats: each is staged in a
    fresh folder that replaces the old one whole.)"""
    import functools

    from transformers import AutoModelForCausalLM

    trainer = _trainer(tmp_path, tiny_model_dir, max_steps=1, save_strategy="no")
    out = str(tmp_path / "final")
    ck.save_final_model(trainer, out)
    assert "model.safetensors" in os.listdir(out)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)  # the new weights differ from the saved ones everywhere
    single = trainer.model.save_pretrained
    trainer.model.save_pretrained = functools.partial(single, max_shard_size="100KB")
    ck.save_final_model(trainer, out)
    names = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in names and "model.safetensors" not in names, names
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ours = trainer.model.state_dict()
    assert all(torch.equal(v, ours[k]) for k, v in loaded.state_dict().items())
    trainer.model.save_pretrained = single  # and back to one file: the shards and their index go
    ck.save_final_model(trainer, out)
    names = sorted(os.listdir(out))
    assert [n for n in names if n.startswith("model")] == ["model.safetensors"], names
    again = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, ours[k]) for k, v in again.items())


def test_a_checkpoint_saved_again_in_the_other_format_keeps_no_old_weights(tmp_path):
    """A checkpoint is staged in a fresh folder that replaces the old one whole: a sharded re-save of a step saved as
    one file before leaves no model.safetensors behind."""
    _marked(tmp_path, 3)  # model.safetensors
    tmp = os.path.join(tmp_path, "_tmp-checkpoint-3")
    os.makedirs(tmp)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        with open(os.path.join(tmp, name), "w") as f:
            f.write("shard")
    ck.commit(tmp, os.path.join(tmp_path, "checkpoint-3"))
    assert sorted(os.listdir(tmp_path / "checkpoint-3")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        ck.MARKER]


def test_a_final_save_killed_between_two_shard_renames_loads_the_previous_model_whole(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    """The final model's shards move into output_dir one rename at a time. With the same shard names on both saves, a
    kill after the first rename left shard 1 new and shard 2 old beside the old index, and that mix loaded silently.
    Each save's shards now carry names of their own: until the index itself is renamed, the old index names the old
    shards, whole."""
    import functools

    from transformers import AutoModelForCausalLM

    trainer = _trainer(tmp_path, tiny_model_dir, max_steps=1, save_strategy="no")
    trainer.model.save_pretrained = functools.partial(trainer.model.save_pretrained, max_shard_size="100KB")
    out = str(tmp_path / "final")
    ck.save_final_model(trainer, out)
    old = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert len([n for n in os.listdir(out) if n.endswith(".safetensors")]) > 1  # sharded
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)

    class Killed(BaseException):
        pass

    real_replace, moved = os.replace, []

    def replace(src, dst):
        if os.path.dirname(dst) == out and src.endswith(".safetensors") and moved:
            raise Killed  # the process dies after one shard has moved
        if os.path.dirname(dst) == out:
            moved.append(src)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        ck.save_final_model(trainer, out)
    monkeypatch.setattr(os, "replace", real_replace)
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, old[k]) for k, v in loaded.items())
    # and a later save completes over the leftovers: the new model, no stale shard beside it
    shutil.rmtree(os.path.join(out, ck.TMP_PREFIX + "final-model"))  # the dead process's staging folder
    ck.save_final_model(trainer, out)
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    ours = trainer.model.state_dict()
    assert all(torch.equal(v, ours[k]) for k, v in loaded.items())
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == sorted(set(index["weight_map"].values()))
