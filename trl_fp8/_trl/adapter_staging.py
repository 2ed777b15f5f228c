"""The server's side of an adapter version sent as bytes (``trl-fp8 vllm-serve``'s worker extension): chunks written to
the server's own RAM-backed folder, checked against the digest the trainer sent, made a PEFT adapter folder in one
rename — so the trainer and the server need not share a filesystem (another machine, a container's private
``/dev/shm``).

Where: ``/dev/shm/trl_fp8_served_<pid>`` (mode 0700, an ``owner`` file naming the process), else the system's
temporary folder; before the first byte, the room is checked — a version that does not fit in RAM goes to the disk
folder (said once in the answer), one that fits nowhere is refused naming what is needed and what is free. Folders of
dead server processes on this host are removed at the first stage. Pure Python: no torch.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import json
import os
import shutil
import tempfile

PREFIX = "trl_fp8_served_"
MARGIN_BYTES = 4 * 2 ** 20  # kept free beyond a version's bytes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_root(base: str) -> str:
    root = os.path.join(base, f"{PREFIX}{os.getpid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    with open(os.path.join(root, "owner"), "w") as f:
        json.dump({"pid": os.getpid()}, f)
    atexit.register(shutil.rmtree, root, True)
    return root


def clean_dead(base: str) -> list[str]:
    """Remove the staging folders of server processes of this host that are gone (a SIGKILL leaves them)."""
    removed = []
    for folder in glob.glob(os.path.join(base, f"{PREFIX}*")):
        try:
            with open(os.path.join(folder, "owner")) as f:
                pid = int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class Staging:
    """One server process's staged adapter versions (see the module docstring)."""

    def __init__(self, ram: str | None = "/dev/shm", disk: str | None = None):
        self.bases = [b for b in (ram, disk or tempfile.gettempdir()) if b and os.path.isdir(b) and
                      os.access(b, os.W_OK)]
        self.roots: dict[str, str] = {}  # base -> this process's root under it
        self.where: dict[str, str] = {}  # version name -> the root it is staged under
        self.cleaned = False

    def _root(self, base: str) -> str:
        if base not in self.roots:
            self.roots[base] = _make_root(base)
        return self.roots[base]

    def _choose(self, name: str, size: int) -> tuple[str, str]:
        """The root for a version of ``size`` bytes, and a note when it is not the first choice."""
        if not self.cleaned:
            for base in self.bases:
                clean_dead(base)
            self.cleaned = True
        seen = []
        for base in self.bases:
            free = shutil.disk_usage(base).free
            seen.append(f"{base}: {free / 2 ** 20:.1f} MiB free")
            if free >= size + MARGIN_BYTES:
                note = "" if base == self.bases[0] else f"staged on disk at {base} ({'; '.join(seen[:-1])})"
                return self._root(base), note
        raise OSError(f"adapter version {name!r} needs {size / 2 ** 20:.1f} MiB (+{MARGIN_BYTES / 2 ** 20:.0f} MiB "
                      f"margin) and no staging folder has room ({'; '.join(seen)}): give the server a larger /dev/shm "
                      "(docker run --shm-size=1g) or free its temporary folder")

    def _part(self, name: str) -> str:
        return os.path.join(self.where[name], f"{name}.part.{os.getpid()}")

    def chunk(self, name: str, offset: int, data: bytes, size: int) -> dict:
        """Write ``data`` at ``offset`` of version ``name`` (``size`` bytes in all: the room is checked at offset 0)."""
        _check_name(name)
        note = ""
        if offset == 0:
            root, note = self._choose(name, size)
            self.where[name] = root
        elif name not in self.where:
            raise ValueError(f"adapter version {name!r}: chunk at offset {offset} before its first chunk")
        with open(self._part(name), "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(data)
        return {"written": offset + len(data), "note": note}

    def commit(self, name: str, size: int, sha256: str, config: dict) -> dict:
        """Check the staged bytes (size and digest), then make them a PEFT adapter folder in one rename."""
        _check_name(name)
        if name not in self.where:
            raise ValueError(f"adapter version {name!r}: commit before any chunk")
        part = self._part(name)
        digest, got = hashlib.sha256(), 0
        with open(part, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                got += len(block)
        if got != size or digest.hexdigest() != sha256:
            os.remove(part)
            raise ValueError(f"adapter version {name!r} arrived damaged: {got} bytes with sha256 "
                             f"{digest.hexdigest()[:16]}…, sent {size} bytes with {sha256[:16]}…")
        final = os.path.join(self.where[name], name)
        staging = f"{final}.tmp.{os.getpid()}"
        os.makedirs(staging, exist_ok=True)
        os.replace(part, os.path.join(staging, "adapter_model.safetensors"))
        with open(os.path.join(staging, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        if os.path.isdir(final) and _digest_of(final) == sha256:  # another worker of this host staged these bytes
            shutil.rmtree(staging, ignore_errors=True)
            return {"path": final}
        if os.path.isdir(final):  # an earlier version of the same name (a re-run's leftover): replaced, never kept
            aside = f"{final}.old.{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(staging, final)
        except OSError:  # another worker of this host renamed its copy in between: kept only if it holds these bytes
            shutil.rmtree(staging, ignore_errors=True)
            if _digest_of(final) != sha256:
                raise ValueError(f"adapter version {name!r}: {final} holds other bytes than the version sent "
                                 "(another process staged the same name)") from None
        return {"path": final}

    def drop(self, name: str) -> None:
        _check_name(name)
        root = self.where.pop(name, None)
        if root is not None:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            for leftover in glob.glob(os.path.join(root, f"{name}.*")):
                if os.path.isdir(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    os.remove(leftover)


def _digest_of(folder: str) -> str | None:
    """The sha256 of a staged folder's adapter bytes (None when it has none)."""
    digest = hashlib.sha256()
    try:
        with open(os.path.join(folder, "adapter_model.safetensors"), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or "\\" in name:
        raise ValueError(f"adapter version name {name!r} is not a plain file name")
