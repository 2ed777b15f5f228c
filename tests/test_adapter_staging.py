"""The server's side of an adapter version sent as bytes (trl_fp8._trl.adapter_staging): chunks staged in the server's
own folder, checked against the sent digest, made a folder in one rename; the room checked first; dead servers'
folders removed. Pure Python, no server."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from trl_fp8._trl import adapter_staging as staging


def _send(stage, name, blob, chunk=5):
    for offset in range(0, len(blob), chunk):
        stage.chunk(name, offset, blob[offset:offset + chunk], len(blob))
    return stage.commit(name, len(blob), hashlib.sha256(blob).hexdigest(), {"r": 4})


def test_chunks_become_an_adapter_folder_in_the_servers_own_ram_folder(tmp_path):
    ram, disk = tmp_path / "shm", tmp_path / "tmp"
    ram.mkdir(), disk.mkdir()
    stage = staging.Staging(str(ram), str(disk))
    blob = bytes(range(256)) * 3
    path = _send(stage, "trl_fp8-ab12-v1", blob)["path"]
    assert os.path.dirname(path) == str(ram / f"{staging.PREFIX}{os.getpid()}")
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"  # the server's own, not world-readable
    assert open(os.path.join(path, "adapter_model.safetensors"), "rb").read() == blob
    assert json.load(open(os.path.join(path, "adapter_config.json"))) == {"r": 4}
    assert sorted(os.listdir(os.path.dirname(path))) == ["owner", "trl_fp8-ab12-v1"]  # no part file left
    stage.drop("trl_fp8-ab12-v1")
    assert not os.path.exists(path)


def test_a_name_staged_again_with_other_bytes_serves_the_new_bytes(tmp_path):
    """A re-run pushes its version names again while an earlier run's folder of the same name is still staged (it was
    killed before dropping it): the new bytes replace the folder — the old one was kept before, and the server
    served the killed run's factors under the new run's version."""
    stage = staging.Staging(str(tmp_path), None)
    old, new = b"old factors" * 7, b"new factors" * 7
    path = _send(stage, "trl_fp8-ab12-v1", old)["path"]
    assert _send(stage, "trl_fp8-ab12-v1", new)["path"] == path
    assert open(os.path.join(path, "adapter_model.safetensors"), "rb").read() == new
    assert sorted(os.listdir(os.path.dirname(path))) == ["owner", "trl_fp8-ab12-v1"]  # nothing set aside is left
    assert _send(stage, "trl_fp8-ab12-v1", new)["path"] == path  # the same bytes again (a second worker): kept
    assert open(os.path.join(path, "adapter_model.safetensors"), "rb").read() == new


def test_damaged_bytes_are_refused_and_nothing_is_left(tmp_path):
    stage = staging.Staging(str(tmp_path), None)
    blob = b"x" * 40
    for offset in range(0, 40, 8):
        stage.chunk("v1", offset, blob[offset:offset + 8], 40)
    with pytest.raises(ValueError, match=r"'v1' arrived damaged: 40 bytes with sha256 .* sent 40 bytes"):
        stage.commit("v1", 40, hashlib.sha256(b"y" * 40).hexdigest(), {})
    root = tmp_path / f"{staging.PREFIX}{os.getpid()}"
    assert sorted(os.listdir(root)) == ["owner"]
    with pytest.raises(ValueError, match="before its first chunk"):
        stage.chunk("v2", 8, b"abc", 11)
    for bad in ("../x", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="not a plain file name"):
            stage.chunk(bad, 0, b"abc", 3)


def test_the_room_is_checked_first_a_version_too_large_for_ram_goes_to_disk_or_is_refused(tmp_path, monkeypatch):
    ram, disk = tmp_path / "shm", tmp_path / "tmp"
    ram.mkdir(), disk.mkdir()
    free = {str(ram): 64 * 2 ** 20, str(disk): 10 * 2 ** 30}  # Docker's default /dev/shm: 64 MiB

    class Usage:
        def __init__(self, path):
            self.free = free[path]

    monkeypatch.setattr(staging.shutil, "disk_usage", Usage)
    stage = staging.Staging(str(ram), str(disk))
    answer = stage.chunk("big", 0, b"abc", 81 * 2 ** 20)  # a 7B r=16 adapter: 81 MiB
    assert answer["note"].startswith(f"staged on disk at {disk}") and "64.0 MiB free" in answer["note"]
    assert stage.where["big"].startswith(str(disk))
    free[str(disk)] = 2 ** 20
    with pytest.raises(OSError, match=r"'huge' needs 81.0 MiB .* no staging folder has room .*64.0 MiB free.*"
                                      r"--shm-size"):
        staging.Staging(str(ram), str(disk)).chunk("huge", 0, b"abc", 81 * 2 ** 20)


def test_folders_of_dead_servers_are_removed_at_the_first_stage(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    gone = tmp_path / f"{staging.PREFIX}{pid}"
    gone.mkdir()
    (gone / "owner").write_text(json.dumps({"pid": pid}))
    (gone / "trl_fp8-x-v3").mkdir()
    alive = tmp_path / f"{staging.PREFIX}1"  # pid 1 is alive
    alive.mkdir()
    (alive / "owner").write_text(json.dumps({"pid": 1}))
    stranger = tmp_path / f"{staging.PREFIX}nobody"  # no owner file: not ours to judge
    stranger.mkdir()
    stage = staging.Staging(str(tmp_path), None)
    stage.chunk("v1", 0, b"abc", 3)
    assert not gone.exists() and alive.exists() and stranger.exists()
