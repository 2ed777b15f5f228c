"""Trackers: W&B (offline) and trackio (local) receive every trl_fp8 metric and TRL's completions table, and a
resumed session continues the same run. Checked by reading back what each tracker wrote: W&B's offline
transaction log (``run-<id>.wandb``) and trackio's local SQLite database.

Two real training sessions run in subprocesses (a tracker's storage folder is read from the environment when it
is imported, and a new session is a new process in real life too): session 1 trains 2 steps and saves a
checkpoint, session 2 resumes from it (TRL's own ``resume_from_checkpoint=True``) and trains 2 more.
"""

import json
import math
import os
import sqlite3
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from trl_fp8 import trackers

# trl_fp8's own metric namespaces (what the capabilities record into TRL's metrics)
TRL_FP8_PREFIXES = ("fair_cast/", "sync/", "duet/", "qlora/", "mxfp8/")
# what Fair Cast and the default weight-sync checks must log on every step of this run, at least
EXPECTED = {"fair_cast/visible_update_frac", "fair_cast/max_abs_err_ulps", "sync/coverage", "sync/freshness",
            "sync/logprob_agreement", "sync/logp_gap_mean", "sync/logp_gap_max"}
PROJECT = "trl-fp8-test"

SESSION = r"""
import json, os, sys
from trl_fp8 import GRPOConfig, GRPOTrainer
from trl_fp8.app.demo.model import demo_model_path
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

out, max_steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
args = GRPOConfig(
    output_dir=out, use_cpu=True, bf16=False, max_steps=max_steps, learning_rate=1e-3, seed=3,
    per_device_train_batch_size=8, num_generations=4, max_completion_length=8, gradient_checkpointing=False,
    logging_steps=1, save_strategy="steps", save_steps=2, disable_tqdm=True,
    report_to=["wandb", "trackio"], project="%s", log_completions=True, num_completions_to_print=0,
    fair_cast="stochastic", metrics_jsonl=os.path.join(out, "metrics.jsonl"),
)
trainer = GRPOTrainer(model=demo_model_path(), reward_funcs=[correctness_reward, format_reward], args=args,
                      train_dataset=make_arithmetic_dataset(64, seed=1))
trainer.train(resume_from_checkpoint=True if resume else None)
import wandb
print("SESSION " + json.dumps({"global_step": trainer.state.global_step, "wandb_run_id": wandb.run.id,
                               "run_name": args.run_name, "env_after": os.environ.get("WANDB_RUN_ID")}))
wandb.finish()
""" % PROJECT


# -- reading W&B's offline run file -------------------------------------------------------------------------------
# wandb >= 0.30 ships no Python reader of its run files (the `datastore` module and `wandb sync --view` are gone;
# wandb-core writes and reads them). The format is LevelDB's log format (32 KiB blocks of checksummed chunks) after a
# 7-byte ":W&B" header, each record a protobuf `wandb.proto.wandb_internal_pb2.Record`: read it that way.
def wandb_records(path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B run file"
    block, header = 32768, 7
    pos, pending = 7, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # block trailer: zero padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        if kind == 0 and length == 0:  # preallocated, not yet written
            break
        assert checksum == zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF, f"{path}: bad checksum"
        if kind in (1, 2):  # FULL, FIRST
            pending = chunk
        else:  # MIDDLE, LAST
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run(run_dir):
    """(run id, [history rows as dicts of decoded values]) of one offline run folder."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    run_id, rows = None, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows


def trackio_rows(trackio_dir):
    """[(run id, run name, step, metrics dict)] of the test project, read from trackio's SQLite file."""
    (db,) = Path(trackio_dir).glob("*.db")
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT run_id, run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    return [(run_id, name, step, json.loads(metrics)) for run_id, name, step, metrics in rows]


# -- the two sessions ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(root / "wandb"), WANDB_SILENT="true",
               WANDB_CONFIG_DIR=str(root / "wandb_config"), WANDB_CACHE_DIR=str(root / "wandb_cache"),
               TRACKIO_DIR=str(root / "trackio"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    (root / "wandb").mkdir()
    out = root / "run"
    results = []
    for max_steps, mode in ((2, "fresh"), (4, "resume")):
        proc = subprocess.run([sys.executable, "-c", SESSION, str(out), str(max_steps), mode], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("SESSION ")]
        results.append({**json.loads(line[len("SESSION "):]), "stdout": proc.stdout})
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"root": root, "out": out, "sessions": results, "metrics": metrics}


def _trl_fp8_records(metrics):
    """{global step: {trl_fp8 key: value}} of what the run logged (trl_fp8's own metrics.jsonl)."""
    out = {}
    for record in metrics:
        keys = {k: v for k, v in record.items() if k.startswith(TRL_FP8_PREFIXES)}
        if keys:
            out.setdefault(record["step"], {}).update(keys)
    return out


def _close(a, b):
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)


@pytest.mark.slow
def test_sessions_ran_and_resumed(sessions):
    first, second = sessions["sessions"]
    assert (first["global_step"], second["global_step"]) == (2, 4)
    logged = _trl_fp8_records(sessions["metrics"])
    assert sorted(logged) == [1, 2, 3, 4]
    for step, keys in logged.items():
        assert EXPECTED <= set(keys), f"step {step}: {sorted(EXPECTED - set(keys))} not logged"


@pytest.mark.slow
def test_wandb_receives_every_trl_fp8_metric_and_the_completions_table(sessions):
    runs = [wandb_run(d) for d in sorted((sessions["root"] / "wandb" / "wandb").glob("offline-run-*"))]
    assert len(runs) == 2, "one offline run folder per session"
    rows = [row for _, run_rows in runs for row in run_rows]
    by_step = {}
    for row in rows:
        if "train/global_step" in row:
            by_step.setdefault(row["train/global_step"], {}).update(row)
    for step, keys in _trl_fp8_records(sessions["metrics"]).items():
        assert step in by_step, f"no W&B history row for global step {step}"
        for key, value in keys.items():
            assert f"train/{key}" in by_step[step], f"W&B lacks train/{key} at step {step}"
            assert _close(by_step[step][f"train/{key}"], value), (key, step, by_step[step][f"train/{key}"], value)
    # TRL's completions table: one per logging step, a table file with the prompt/completion/reward columns
    tables = [row for row in rows if row.get("completions/_type") == "table-file"]
    assert len(tables) >= 4
    run_dirs = sorted((sessions["root"] / "wandb" / "wandb").glob("offline-run-*"))
    steps_seen = set()
    for table in tables:
        files = [d / "files" / table["completions/path"] for d in run_dirs if (d / "files" / table["completions/path"]).exists()]
        assert files, f"table file {table['completions/path']} not written"
        content = json.loads(files[0].read_text())
        assert {"step", "prompt", "completion", "correctness_reward", "format_reward", "advantage"} <= set(
            content["columns"])
        assert len(content["data"]) == table["completions/nrows"] > 0
        steps_seen |= {row[content["columns"].index("step")] for row in content["data"]}
    assert steps_seen == {1, 2, 3, 4}


@pytest.mark.slow
def test_trackio_receives_every_trl_fp8_metric_and_the_completions_table(sessions):
    rows = trackio_rows(sessions["root"] / "trackio")
    by_step = {}
    for _, _, _, metrics in rows:
        if "train/global_step" in metrics:
            by_step.setdefault(metrics["train/global_step"], {}).update(metrics)
    for step, keys in _trl_fp8_records(sessions["metrics"]).items():
        assert step in by_step, f"no trackio row for global step {step}"
        for key, value in keys.items():
            assert f"train/{key}" in by_step[step], f"trackio lacks train/{key} at step {step}"
            assert _close(by_step[step][f"train/{key}"], value), (key, step, by_step[step][f"train/{key}"], value)
    tables = [m["completions"] for _, _, _, m in rows if "completions" in m]
    assert tables and all(t["_type"] == "trackio.table" for t in tables)
    steps_seen = set()
    for table in tables:
        assert table["_value"], "empty completions table"
        for row in table["_value"]:
            assert {"step", "prompt", "completion", "correctness_reward", "format_reward", "advantage"} <= set(row)
            steps_seen.add(row["step"])
    assert steps_seen == {1, 2, 3, 4}


@pytest.mark.slow
def test_resumed_session_continues_the_same_run(sessions):
    first, second = sessions["sessions"]
    stored = trackers.read_identity(sessions["out"])
    assert stored is not None
    # W&B: both sessions ran under the stored id (one offline folder each; `wandb sync` joins them into one run)
    assert first["wandb_run_id"] == second["wandb_run_id"] == stored.run_id
    runs = [wandb_run(d) for d in sorted((sessions["root"] / "wandb" / "wandb").glob("offline-run-*"))]
    assert [run_id for run_id, _ in runs] == [stored.run_id, stored.run_id]
    steps = [sorted({r["train/global_step"] for r in rows if "train/loss" in r}) for _, rows in runs]
    assert steps == [[1, 2], [3, 4]]  # the second session continues the chart where the checkpoint left it
    # trackio: one run (its own id and our name) holds the rows of both sessions, its steps keep increasing
    rows = trackio_rows(sessions["root"] / "trackio")
    assert {(run_id, name) for run_id, name, _, _ in rows} == {(rows[0][0], stored.run_name)}
    assert first["run_name"] == second["run_name"] == stored.run_name
    assert "Resumed existing run" in second["stdout"]
    global_steps = [m["train/global_step"] for _, _, _, m in rows if "train/global_step" in m and "train/loss" in m]
    assert global_steps == [1, 2, 3, 4]
    # the environment variables set for W&B are gone after training
    assert first["env_after"] is None and second["env_after"] is None


# -- the run identity, unit by unit -------------------------------------------------------------------------------
class _State:
    def __init__(self, global_step=0, zero=True):
        self.global_step, self.is_world_process_zero = global_step, zero


class _Args:
    def __init__(self, output_dir, report_to=("wandb", "trackio"), run_name=None):
        self.output_dir, self.report_to, self.run_name = str(output_dir), list(report_to), run_name


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)


def test_identity_is_new_for_a_fresh_run_and_kept_for_a_resumed_one(tmp_path):
    first = trackers.resolve_identity(tmp_path, resumed=False)
    assert trackers.read_identity(tmp_path) == first
    assert trackers.resolve_identity(tmp_path, resumed=True) == first
    fresh = trackers.resolve_identity(tmp_path, resumed=False)  # a restart from step 0: a new chart
    assert fresh.run_id != first.run_id and trackers.read_identity(tmp_path) == fresh
    assert len(fresh.run_id) == 8 and fresh.run_id.isalnum() and fresh.run_name == f"{tmp_path.name}-{fresh.run_id}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [trackers.RUN_FILE]  # no temp file left behind


def test_resume_without_a_stored_identity_starts_one(tmp_path):
    identity = trackers.resolve_identity(tmp_path / "new", resumed=True)
    assert trackers.read_identity(tmp_path / "new") == identity


def test_unreadable_identity_file_is_replaced(tmp_path, caplog):
    (tmp_path / trackers.RUN_FILE).write_text("{not json")
    assert trackers.read_identity(tmp_path) is None
    assert "ignoring unreadable" in caplog.text
    identity = trackers.resolve_identity(tmp_path, resumed=True)
    assert trackers.read_identity(tmp_path) == identity


def test_callback_sets_wandb_env_and_run_name_then_restores_env(tmp_path, clean_env):
    callback, args = trackers.RunIdentityCallback(), _Args(tmp_path)
    callback.on_train_begin(args, _State(), None)
    identity = trackers.read_identity(tmp_path)
    assert os.environ["WANDB_RUN_ID"] == identity.run_id and os.environ["WANDB_RESUME"] == "allow"
    assert args.run_name == identity.run_name
    callback.on_train_end(args, _State(), None)
    assert "WANDB_RUN_ID" not in os.environ and "WANDB_RESUME" not in os.environ
    # the same trainer trained again from a checkpoint: its own run name is not taken for the user's
    callback.on_train_begin(args, _State(global_step=2), None)
    assert os.environ["WANDB_RUN_ID"] == identity.run_id and args.run_name == identity.run_name
    callback.on_train_end(args, _State(), None)


def test_user_settings_win(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("WANDB_RUN_ID", "mine1234")
    callback, args = trackers.RunIdentityCallback(), _Args(tmp_path, run_name="my-run")
    callback.on_train_begin(args, _State(), None)
    assert os.environ["WANDB_RUN_ID"] == "mine1234" and "WANDB_RESUME" not in os.environ
    assert args.run_name == "my-run"
    callback.on_train_end(args, _State(), None)
    assert os.environ["WANDB_RUN_ID"] == "mine1234"
    monkeypatch.delenv("WANDB_RUN_ID")
    monkeypatch.setenv("WANDB_RESUME", "must")
    callback.on_train_begin(_Args(tmp_path, report_to=["wandb"]), _State(), None)
    assert os.environ["WANDB_RESUME"] == "must" and os.environ["WANDB_RUN_ID"]
    callback.on_train_end(args, _State(), None)
    assert os.environ["WANDB_RESUME"] == "must" and "WANDB_RUN_ID" not in os.environ


def test_callback_does_nothing_off_the_main_process_or_without_trackers(tmp_path, clean_env):
    trackers.RunIdentityCallback().on_train_begin(_Args(tmp_path), _State(zero=False), None)
    trackers.RunIdentityCallback().on_train_begin(_Args(tmp_path, report_to=["tensorboard"]), _State(), None)
    assert not any(tmp_path.iterdir()) and "WANDB_RUN_ID" not in os.environ
    # trackio only: the run name, no W&B variables
    args = _Args(tmp_path, report_to=["trackio"])
    trackers.RunIdentityCallback().on_train_begin(args, _State(), None)
    assert args.run_name == trackers.read_identity(tmp_path).run_name and "WANDB_RUN_ID" not in os.environ


def test_unwritable_output_dir_falls_back_to_a_session_id(tmp_path, clean_env, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = _Args(blocker / "out", report_to=["wandb"])
    callback = trackers.RunIdentityCallback()
    callback.on_train_begin(args, _State(), None)
    assert "cannot store the tracker run id" in caplog.text
    assert os.environ["WANDB_RUN_ID"] == callback.identity.run_id
    callback.on_train_end(args, _State(), None)


def test_attach_puts_the_callback_before_the_trackers():
    class _Handler:
        callbacks = ["DefaultFlowCallback", "WandbCallback"]

    class _Trainer:
        callback_handler = _Handler()
        args = _Args("out", report_to=["wandb"])

    trainer = _Trainer()
    trackers.attach(trainer)
    assert isinstance(trainer.callback_handler.callbacks[0], trackers.RunIdentityCallback)
    trainer.args = _Args("out", report_to=[])
    trainer.callback_handler.callbacks = ["DefaultFlowCallback"]
    trackers.attach(trainer)
    assert trainer.callback_handler.callbacks == ["DefaultFlowCallback"]


def test_env_is_restored_when_train_raises(tmp_path, clean_env, tiny_model_dir):
    """The identity callback sets WANDB_RUN_ID / WANDB_RESUME at train begin and removed them only at train end,
    which a training that raises never reaches: the next run in the same process (a notebook's next cell) then
    continued the failed run's W&B chart. train() restores them in a finally."""
    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    def failing_reward(completions, **kwargs):
        raise RuntimeError("reward server down")

    args = trl_fp8.GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=2,
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                              report_to="none", disable_tqdm=True, save_strategy="no")
    trainer = trl_fp8.GRPOTrainer(model=tiny_model_dir, reward_funcs=[failing_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(16, seed=1))
    trainer.args.report_to = ["wandb"]  # the callback without starting W&B itself (its callback was not added)
    trackers.attach(trainer)
    seen = []
    trainer.add_callback(type("Seen", (trackers.TrainerCallback,), {
        "on_train_begin": lambda self, *a, **k: seen.append(os.environ.get("WANDB_RUN_ID"))})())
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert seen == [trackers.read_identity(tmp_path / "run").run_id]  # it was set during training
    assert "WANDB_RUN_ID" not in os.environ and "WANDB_RESUME" not in os.environ
