"""Serving a LoRA run to a vLLM server (``trl-fp8 vllm-serve``) as base + adapters: no merge, no dense transfer, no
NCCL — so it runs on a CPU too.

What vLLM 0.32's server offers, read in its installed sources: ``POST /v1/load_lora_adapter`` (``lora_name``,
``lora_path``; needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) registers a LoRA under a new int id and has the engine
load it into its CPU cache (``entrypoints/openai/models/serving.py``: ``engine_client.add_lora``); a completion request
whose ``model`` is that name is generated with it, and its response names the ``model`` it was generated with;
``POST /v1/unload_lora_adapter`` only forgets the name in the API server (the workers keep it in their LRU cache);
``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``) calls a method of every worker with string arguments, e.g. one
added by ``--worker-extension-cls``. There is no public in-memory load (vllm RFC #48297 is open).

So each sync (:meth:`VLLMServerLoraStream.push`):

1. writes the served factors — ``A`` and ``s·B`` in the engine's dtype, declared with ``lora_alpha = r`` so vLLM
   scales by 1 and rounds nothing again — as a PEFT adapter folder under a RAM-backed directory (``/dev/shm`` where
   there is one), under a versioned name ``trl_fp8-v<n>`` (a new LoRA id every version: no prefix-cache block
   computed with an older version can be reused);
2. loads it with ``/v1/load_lora_adapter`` and makes it the ``model`` of every generate request the client sends;
3. has every worker drop every other version from its cache (:class:`trl_fp8._trl.vllm_worker.AdapterWorker`), so
   what the server holds never grows; unloads the previous name from the API server and deletes its folder.

The checks read a version back through the same worker extension (the factors the workers hold, by PEFT name), and
count the ``model`` every generate response names: a rollout generated with another version, or with the base, is
caught at the step it happens.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import shutil
import tempfile

import torch

from ..sampling import WORKER_EXTENSION
from .adapter_versions import AdapterVersionStream
NAME_PREFIX = "trl_fp8-v"


def encode_tensor(tensor: torch.Tensor) -> dict:
    """A tensor as JSON: dtype, shape and its raw bytes in base64 (exact, any dtype)."""
    t = tensor.detach().contiguous().cpu()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode("ascii")}


def decode_tensor(blob: dict) -> torch.Tensor:
    raw = bytearray(base64.b64decode(blob["data"]))
    dtype = getattr(torch, blob["dtype"])
    if not raw:
        return torch.empty(blob["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(blob["shape"]).clone()


def ram_root() -> str:
    """Where adapter versions are written: a RAM-backed folder (``/dev/shm``) where the machine has one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="trl_fp8_adapters_", dir=base)


class VLLMServerLoraStream(AdapterVersionStream):
    """The adapter stream a ``trl-fp8 vllm-serve`` server is sent, one LoRA version per sync (see the module
    docstring). ``stream()``: ``(PEFT name, factor in the engine's dtype)`` with the scaling folded into B;
    ``spec``: the run's :class:`~trl_fp8.sampling.LoraFacts`. Replaces, on this ``generation`` instance only, TRL's
    ``sync_weights`` and ``_iter_named_params``, and on its client instance ``generate`` (the current version is
    asked for and the version each response names is counted)."""

    def __init__(self, generation, stream, spec, version_fn=None, root: str | None = None):
        super().__init__(generation, stream, spec, version_fn)
        self.client = generation.vllm_client
        self.root = root or ram_root()
        atexit.register(shutil.rmtree, self.root, True)  # RAM-backed: never left behind, however the run ends
        self.base_model = self.client.model
        self.current = None  # (name, version label, lora id)
        self._labels: dict[str, object] = {}  # served name -> version label
        self._read: tuple | None = None  # (name, {PEFT name: tensor}) of the last read-back
        info = self.client.get_server_info()
        self.dtype = getattr(torch, str(info["model_config"]["dtype"]).removeprefix("torch."))
        self.lora_config = info.get("lora_config") or {}
        self.quantization = info["model_config"].get("quantization")

    @classmethod
    def install(cls, generation, stream, spec, version_fn=None) -> VLLMServerLoraStream:
        if getattr(generation, "mode", None) != "server" or getattr(generation, "vllm_client", None) is None:
            raise RuntimeError("VLLMServerLoraStream.install needs TRL's server mode on the main process.")
        lora = cls(generation, stream, spec, version_fn)
        if not lora.lora_config:
            raise ValueError(f"the vLLM server at {lora.client.base_url} was started without LoRA: start it with "
                             "`trl-fp8 vllm-serve --model ... --lora_r R --lora_target_modules ...` (or `vllm serve "
                             f"--enable-lora --worker-extension-cls {WORKER_EXTENSION}`).")
        if int(lora.lora_config.get("max_lora_rank", 0)) < spec.rank:
            raise ValueError(f"the vLLM server's max_lora_rank is {lora.lora_config.get('max_lora_rank')}, below the "
                             f"run's LoRA rank {spec.rank}: restart it with --lora_r {spec.rank}.")
        generation._iter_named_params = lora
        generation.sync_weights = lora.sync
        lora._hook_client()
        return lora

    # -- the push ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def push(self, named, version=None):
        from safetensors.torch import save_file

        from .vllm_lora import check_complete, peft_to_vllm_name

        tensors, sent = {}, {}
        for name, tensor in named:
            if name in sent:
                raise ValueError(f"LoRA push: '{name}' streamed twice in one sync.")
            if tensor.dtype != self.dtype:  # the server would cast it on load: a rounding nobody asked for
                raise ValueError(f"LoRA push: '{name}' is {tensor.dtype}, the server computes in {self.dtype}: export "
                                 "the factors in the server's dtype (start it with --dtype <served dtype>).")
            sent[name] = tensor.detach().to("cpu", copy=True)
            tensors[peft_to_vllm_name(name, self.spec.adapter).removeprefix("base_model.model.")] = sent[name]
        check_complete(tensors)  # refused before anything changes on the server: the previous version keeps serving
        rank = max(t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight"))
        targets = sorted({k.rsplit(".", 3)[0].rsplit(".", 1)[-1] for k in tensors})
        self.push_count += 1
        name = f"{NAME_PREFIX}{self.push_count}"
        folder = os.path.join(self.root, name)
        staging = folder + ".tmp"
        os.makedirs(staging, exist_ok=True)
        save_file({f"base_model.model.{k}": v.contiguous() for k, v in tensors.items()},
                  os.path.join(staging, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "use_rslora": False, "target_modules": targets,
                  "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model}
        with open(os.path.join(staging, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        os.replace(staging, folder)
        response = self.client.session.post(f"{self.client.base_url}/v1/load_lora_adapter",
                                            json={"lora_name": name, "lora_path": folder})
        if response.status_code != 200:  # the previous version keeps serving
            shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(f"the vLLM server refused LoRA version {name!r}: {response.status_code} "
                               f"{response.text[:500]} (is it a `trl-fp8 vllm-serve` server, with "
                               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1?)")
        state = self.worker_state(keep_latest=True)
        previous, self.current = self.current, (name, version, state["id"])
        self.client.model = name  # every generate request asks for this version from now on
        self.pushes.append((name, version, state["id"]))
        self._labels = {n: v for n, v, _ in self.pushes}  # the recent versions' labels, to name a stale one
        if previous is not None:
            self._unload(previous[0])
        self.last_sent, self._read = sent, None
        resident = state["resident"]
        if len(resident) > 1 or resident != [state["id"]]:
            raise RuntimeError(f"LoRA push: the server's workers hold LoRA ids {resident} after loading "
                               f"{state['id']}; they must serve the new version only.")
        return self.current

    def _unload(self, name: str) -> None:
        response = self.client.session.post(f"{self.client.base_url}/v1/unload_lora_adapter",
                                            json={"lora_name": name})
        if response.status_code not in (200, 404):
            raise RuntimeError(f"unloading LoRA version {name!r}: {response.status_code} {response.text}")
        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _rpc(self, method: str, request: dict) -> list:
        results = self.client._post(f"{self.client.base_url}/collective_rpc",
                                    json={"method": method, "args": [json.dumps(request)]})["results"]
        if not results or any(isinstance(r, str) for r in results):
            raise RuntimeError(f"the vLLM server's workers did not answer {method} ({results!r:.300}): start the server "
                               f"with `trl-fp8 vllm-serve` (--worker-extension-cls {WORKER_EXTENSION}).")
        return results

    def worker_state(self, keep_latest: bool = False, names=None, digests: bool = False) -> dict:
        """What the server's workers hold (one answer per worker, which must agree): the newest LoRA id, the ids
        resident, and with ``names`` the newest version's factors under those PEFT names as its LoRA kernels read
        them (its slot buffers), or with ``digests`` their digests only."""
        request = {"keep_latest": keep_latest, "names": list(names or ()), "adapter": self.spec.adapter,
                   "digests": digests}
        results = self._rpc("trl_fp8_lora_state", request)
        first = results[0]
        if any(r["id"] != first["id"] or r["resident"] != first["resident"] for r in results[1:]):
            raise RuntimeError(f"the vLLM server's workers disagree on the LoRA versions they hold: {results!r:.300}")
        return first

    def read_back(self) -> dict[str, torch.Tensor]:
        """The current version's factors as the server's LoRA kernels read them (its workers' slot buffers), by PEFT
        name: read once per round of checks (:meth:`forget`), never kept per version name — a reload in place keeps
        the name and changes the content."""
        if self.current is None:
            return {}
        if self._read is None:
            state = self.worker_state(names=list(self.last_sent))
            if state["id"] != self.current[2]:
                raise RuntimeError(f"the server's newest LoRA id is {state['id']}, the current version's "
                                   f"{self.current[2]}")
            self._read = (self.current[0], {n: decode_tensor(b) for n, b in state["tensors"].items()})
        return self._read[1]

    def forget(self) -> None:
        """A round of checks begins: the next read-back asks the server again."""
        self._read = None

    def served_digests(self, names) -> dict[str, str]:
        """The digests of the current version's factors as the server's kernels read them, computed by its workers
        (16 bytes a factor over HTTP, not the factors)."""
        if self.current is None:
            return {}
        state = self.worker_state(names=list(names), digests=True)
        if state["id"] != self.current[2]:
            return {n: f"the server's newest LoRA id {state['id']}, not {self.current[2]}" for n in names}
        return state["digests"]

    def identity(self, names) -> dict:
        """The served identity of the server's base under the learner's names
        (:func:`trl_fp8.sync_checks.identity.engine_identity`, computed by every worker, which must agree)."""
        results = self._rpc("trl_fp8_identity", {"names": list(names)})
        if any(r != results[0] for r in results[1:]):
            raise RuntimeError("the vLLM server's workers disagree on the base they hold")
        return results[0]

    def version(self):
        return None if self.current is None else self.current[1]

    def set_version(self, version) -> None:
        if self.current is not None:
            self.current = (self.current[0], version, self.current[2])
            self._labels[self.current[0]] = version

    # -- the client's side -----------------------------------------------------------------------------------------
    def _hook_client(self) -> None:
        client, post = self.client, self.client._post
        recording = []

        def observed_post(url, **kwargs):
            response = post(url, **kwargs)
            if recording and url.endswith("/v1/completions"):
                label = self._labels.get(response.get("model"), None if response.get("model") == self.base_model
                                         else f"unknown ({response.get('model')})")
                self._count_generated(label, len(response.get("choices", ())))
            return response

        generate = client.generate

        def generate_observed(*args, **kwargs):
            recording.append(True)
            try:
                return generate(*args, **kwargs)
            finally:
                recording.pop()

        client._post = observed_post
        client.generate = generate_observed
        self._hooks = (observed_post, generate_observed)

    def close(self) -> None:
        """Forget the current version on the server and remove the RAM folder (the server keeps serving its base)."""
        if self.current is not None:
            try:
                self._unload(self.current[0])
            except Exception:  # noqa: BLE001 - the server may be gone at exit; the folder still goes
                pass
        shutil.rmtree(self.root, ignore_errors=True)
