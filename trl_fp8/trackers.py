"""Experiment trackers across sessions: a resumed run continues the same W&B / trackio run.

``report_to="wandb"`` and ``report_to="trackio"`` are transformers' own callbacks; trl_fp8's metrics reach them
through TRL's ``self._metrics`` (see :func:`trl_fp8._trl.record_metric`), and TRL logs its completions table to
both. What they lack on a free-tier machine is continuity: each new session (a Colab or Kaggle restart that
resumes from a checkpoint) would open a new run, so the curve is split over several charts.

:class:`RunIdentityCallback` fixes that. At the start of training (on the main process, before the tracker
callbacks initialise) it reads or writes ``<output_dir>/trl_fp8_run.json``:

- a run that **resumes** from a checkpoint (``state.global_step > 0`` at train begin) reuses the stored id and
  name, so it continues the same chart;
- a run that **starts from step 0** gets a fresh id and name, written atomically (temp file, fsync, rename), so a
  restarted run does not draw step 0 over an old curve.

It hands the identity to the trackers the way they read it: W&B through ``WANDB_RUN_ID`` and
``WANDB_RESUME=allow`` (read by ``wandb.init``), trackio through ``args.run_name`` (transformers calls
``trackio.init(name=args.run_name, resume="allow")``). Anything the user set wins: a ``WANDB_RUN_ID`` or
``WANDB_RESUME`` in the environment, an explicit ``run_name``, or a W&B run already started with ``wandb.init``.
The environment variables it set are removed again at the end of training, also when training raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import string
import sys
import tempfile
from dataclasses import asdict, dataclass

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

RUN_FILE = "trl_fp8_run.json"
TRACKERS = ("wandb", "trackio")
_ID_ALPHABET = string.ascii_lowercase + string.digits  # W&B's own run-id alphabet


@dataclass(frozen=True)
class RunIdentity:
    run_id: str  # the W&B run id
    run_name: str  # the display name (W&B) and the run key (trackio)


def new_identity(output_dir: str | os.PathLike) -> RunIdentity:
    run_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    base = os.path.basename(os.path.normpath(os.fspath(output_dir))) or "run"
    return RunIdentity(run_id=run_id, run_name=f"{base}-{run_id}")


def read_identity(output_dir: str | os.PathLike) -> RunIdentity | None:
    """The identity stored in ``output_dir``, or None (no file, or one that is not a valid identity)."""
    path = os.path.join(os.fspath(output_dir), RUN_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        identity = RunIdentity(run_id=data["run_id"], run_name=data["run_name"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("trl_fp8: ignoring unreadable %s (%s); a new tracker run id is used", path, err)
        return None
    if not (isinstance(identity.run_id, str) and identity.run_id and isinstance(identity.run_name, str)):
        return None
    return identity


def write_identity(output_dir: str | os.PathLike, identity: RunIdentity) -> None:
    """Write ``identity`` to ``output_dir`` atomically: a reader sees the old file or the new one, never half."""
    folder = os.fspath(output_dir)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{RUN_FILE}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(identity), f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, RUN_FILE))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def resolve_identity(output_dir: str | os.PathLike, resumed: bool) -> RunIdentity:
    """The run identity for a session: the stored one when resuming (if any), else a new one, stored."""
    if resumed:
        stored = read_identity(output_dir)
        if stored is not None:
            return stored
    identity = new_identity(output_dir)
    write_identity(output_dir, identity)
    return identity


def wanted_trackers(args) -> tuple[str, ...]:
    report_to = getattr(args, "report_to", None) or []
    if isinstance(report_to, str):
        report_to = [report_to]
    return tuple(t for t in TRACKERS if t in report_to)


class RunIdentityCallback(TrainerCallback):
    """Gives the W&B and trackio callbacks the same run on every session of a resumed training.

    Must run before them at ``on_train_begin``: :func:`attach` puts it first in the trainer's callback list.
    """

    def __init__(self):
        self.identity: RunIdentity | None = None
        self._env_set: dict[str, str] = {}  # the variables this callback set, with the value it set
        self._run_name_set: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._restore_env()
        trackers = wanted_trackers(args)
        if not trackers or not state.is_world_process_zero:
            return
        try:
            self.identity = resolve_identity(args.output_dir, resumed=state.global_step > 0)
        except OSError as err:
            logger.warning("trl_fp8: cannot store the tracker run id in %s (%s); a resumed session will open a "
                           "new tracker run", args.output_dir, err)
            self.identity = new_identity(args.output_dir)
        if args.run_name is None or args.run_name == self._run_name_set:
            args.run_name = self._run_name_set = self.identity.run_name
        if "wandb" in trackers and not _wandb_run_active():
            if "WANDB_RUN_ID" not in os.environ:  # a user-set id wins (and so does the user's WANDB_RESUME)
                self._setenv("WANDB_RUN_ID", self.identity.run_id)
                if "WANDB_RESUME" not in os.environ:
                    self._setenv("WANDB_RESUME", "allow")

    def on_train_end(self, args, state, control, **kwargs):
        self._restore_env()

    def _setenv(self, name: str, value: str) -> None:
        os.environ[name] = value
        self._env_set[name] = value

    def _restore_env(self) -> None:
        for name, value in self._env_set.items():
            if os.environ.get(name) == value:  # untouched since: ours to remove
                del os.environ[name]
        self._env_set.clear()


def _wandb_run_active() -> bool:
    wandb = sys.modules.get("wandb")  # never import wandb just to ask
    return wandb is not None and getattr(wandb, "run", None) is not None


def restore_env(trainer) -> None:
    """Remove the tracker variables ``trainer``'s identity callback set (``train()`` calls it in a ``finally``: a
    training that raises never reaches ``on_train_end``, and the next run in the process would continue its chart)."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, RunIdentityCallback):
            callback._restore_env()


def attach(trainer) -> None:
    """When ``trainer`` reports to W&B or trackio, put a :class:`RunIdentityCallback` first in its callbacks
    (transformers adds the tracker callbacks before any other, and they start their run at ``on_train_begin``)."""
    if wanted_trackers(trainer.args):
        trainer.callback_handler.callbacks.insert(0, RunIdentityCallback())
