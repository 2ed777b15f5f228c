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

1. serialises the served factors — ``A`` and ``s·B`` in the engine's dtype, declared with ``lora_alpha = r`` so vLLM
   scales by 1 and rounds nothing again — as a PEFT adapter (safetensors bytes and its config) under a run-scoped
   versioned name ``trl_fp8-<run>-v<n>`` (a new LoRA id every version: no prefix-cache block computed with an older
   version can be reused);
2. sends the bytes to the server's workers in chunks (:data:`CHUNK_BYTES`) through the worker extension, which stage
   them in the server's own RAM-backed folder and check them against their sha256
   (:mod:`trl_fp8._trl.adapter_staging`): nothing assumes that the trainer and the server share a filesystem;
3. loads the staged folder with ``/v1/load_lora_adapter`` and makes it the ``model`` of every generate request;
4. has every worker drop every other version from its cache (:class:`trl_fp8._trl.vllm_worker.AdapterWorker`), so
   what the server holds never grows; unloads the previous name from the API server and has its folder removed.

``<run>`` is derived from the host and the run's output folder: at start the stream unloads what an earlier run of
the same output folder left on the server (a re-run after an error, a resume) and leaves other runs' versions alone.
Every call has a timeout (scaled to the bytes it carries) and every error is one line naming the server and the call.

The checks read a version back through the same worker extension (the factors the workers' LoRA kernels read, by
PEFT name), and count the ``model`` every generate response names: a rollout generated with another version, or with
the base, is caught at the step it happens.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import sys

import torch

from ..sampling import WORKER_EXTENSION
from .adapter_versions import AdapterVersionStream

NAME_PREFIX = "trl_fp8-"  # + <run>-v<n>
CHUNK_BYTES = 8 * 2 ** 20  # bytes of a version per /collective_rpc call (base64 in JSON: 4/3 of that on the wire)
CALL_TIMEOUT_S = 60.0  # the least any server call is given ...
BYTES_PER_S = 8 * 2 ** 20  # ... plus its bytes at this rate (a slow link, a busy server)


class ServerError(RuntimeError):
    """A vLLM server call that failed: one line naming the server and the call (``trl-fp8 grpo`` prints it as is)."""


class ServerGone(ServerError):
    """The server stopped answering and did not come back within :data:`RESTART_WAIT_S`. Raised inside a step,
    before its optimizer update: the trainer saves the last complete step's checkpoint first (one process)."""


def run_id(output_dir: str | None) -> str:
    """The run's scope on a server: the host and the output folder (a re-run or a resume of the same run keeps it)."""
    where = os.path.abspath(output_dir) if output_dir else f"pid{os.getpid()}"
    return hashlib.sha1(f"{socket.gethostname()}:{where}".encode()).hexdigest()[:8]


GENERATE_TIMEOUT_S = 1800.0  # a generate request that gets no answer in this long: the server is taken as lost
WAIT_ENV = "TRL_FP8_SERVER_WAIT_S"
# how long a lost server is waited for before the run saves its last complete step and stops (one line), unless
# $TRL_FP8_SERVER_WAIT_S says otherwise (read when a server is lost, not at import)
RESTART_WAIT_S = 300.0


def restart_wait() -> float:
    """The wait for a lost server: ``$TRL_FP8_SERVER_WAIT_S`` when set, else :data:`RESTART_WAIT_S`; a value that is
    not a number >= 0 is refused by name."""
    value = os.environ.get(WAIT_ENV, "").strip()
    if not value:
        return RESTART_WAIT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"${WAIT_ENV}={value!r}: give the seconds a lost vLLM server is waited for (a number >= 0).")
    return seconds


def timeout_for(nbytes: int) -> float:
    return CALL_TIMEOUT_S + nbytes / BYTES_PER_S


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


class VLLMServerLoraStream(AdapterVersionStream):
    """The adapter stream a ``trl-fp8 vllm-serve`` server is sent, one LoRA version per sync (see the module
    docstring). ``stream()``: ``(PEFT name, factor in the engine's dtype)`` with the scaling folded into B;
    ``spec``: the run's :class:`~trl_fp8.sampling.LoraFacts`. Replaces, on this ``generation`` instance only, TRL's
    ``sync_weights`` and ``_iter_named_params``, and on its client instance ``generate`` (the current version is
    asked for and the version each response names is counted)."""

    def __init__(self, generation, stream, spec, version_fn=None, run: str | None = None, http=None):
        """``http``: the session the stream's own calls go through (default: a ``requests.Session`` without
        retries, so a call that fails is said at once, in one line)."""
        import requests

        super().__init__(generation, stream, spec, version_fn)
        self.client = generation.vllm_client
        self.url = self.client.base_url
        self.http = http if http is not None else requests.Session()
        self.prefix = f"{NAME_PREFIX}{run or run_id(None)}-v"
        self.base_model = self.client.model
        self.current = None  # (name, version label, lora id)
        self.paths: dict[str, str] = {}  # served name -> its folder on the server's machine
        self.closed = False
        self._labels: dict[str, object] = {}  # served name -> version label
        self._id_labels: dict[int, object] = {}  # the server's LoRA id -> version label
        self._watch_routes = False  # the checks observe which slot each token reads (every state request says so)
        self._routes_taken = None  # the routes the last digests request read, for routes()
        self._read: tuple | None = None  # (name, {PEFT name: tensor}) of the last read-back
        # set by the served-identity check: compares the base of a server that came back with the learner's again
        self.identity_recheck = None
        self._busy = 0  # inside a push or a restart: a lost server is theirs to handle
        try:  # TRL's client asks without a timeout: a wedged server would hold the trainer here for ever
            response = self.http.get(f"{self.url}/server_info", params={"config_format": "json"},
                                     timeout=CALL_TIMEOUT_S)
        except requests.Timeout:
            raise ServerError(f"the vLLM server at {self.url} did not answer /server_info within "
                              f"{CALL_TIMEOUT_S:.0f} s") from None
        except requests.RequestException as err:
            raise ServerError(f"the vLLM server at {self.url} cannot be reached for /server_info "
                              f"({type(err).__name__}): is it still running?") from None
        try:
            if response.status_code == 404:
                raise RuntimeError("no /server_info route: the development endpoints are off (VLLM_SERVER_DEV_MODE=1)")
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code}, {response.text}")
            info = response.json()["vllm_config"]
        except Exception as err:  # noqa: BLE001 - any answer that is not the server's configuration
            raise ValueError(f"the vLLM server at {self.url} is not a `trl-fp8 vllm-serve` server (its /server_info: "
                             f"{' '.join(str(err).split())[:200]}). Start it with `trl-fp8 vllm-serve --model "
                             f"{self.base_model} --lora_r {spec.rank}`.") from None
        self.dtype = getattr(torch, str(info["model_config"]["dtype"]).removeprefix("torch."))
        self.lora_config = info.get("lora_config") or {}
        self.quantization = info["model_config"].get("quantization")

    @classmethod
    def install(cls, generation, stream, spec, version_fn=None, run: str | None = None,
                http=None) -> VLLMServerLoraStream:
        if getattr(generation, "mode", None) != "server" or getattr(generation, "vllm_client", None) is None:
            raise RuntimeError("VLLMServerLoraStream.install needs TRL's server mode on the main process.")
        lora = cls(generation, stream, spec, version_fn, run, http)
        start = (f"`trl-fp8 vllm-serve --model {lora.base_model} --lora_r {spec.rank}` (the adapters' rank; "
                 "--load_in_4bit for a QLoRA base)")
        if not lora.lora_config:
            raise ValueError(f"the vLLM server at {lora.url} was started without LoRA: start it with {start}.")
        if int(lora.lora_config.get("max_lora_rank", 0)) < spec.rank:
            raise ValueError(f"the vLLM server's max_lora_rank is {lora.lora_config.get('max_lora_rank')}, below the "
                             f"run's LoRA rank {spec.rank}: restart it with --lora_r {spec.rank}.")
        try:  # before anything is pushed: a server without trl_fp8's worker extension is refused in one line
            lora._rpc("trl_fp8_lora_state", {})
        except ServerError as err:
            raise ValueError(f"the vLLM server at {lora.url} is not a `trl-fp8 vllm-serve` server "
                             f"({str(err).removeprefix(f'the vLLM server at {lora.url}').lstrip(': ')}). Start it with "
                             f"{start}.") from None
        lora.forget_earlier_runs()
        generation._iter_named_params = lora
        generation.sync_weights = lora.sync
        lora._hook_client()
        return lora

    # -- the server's calls: one timeout each, one line per failure ------------------------------------------------
    def _call(self, path: str, body: dict, nbytes: int = 0, ok=(200,)):
        import requests

        timeout = timeout_for(nbytes)
        try:
            response = self.http.post(f"{self.url}{path}", json=body, timeout=timeout)
        except requests.Timeout:
            raise ServerError(f"the vLLM server at {self.url} did not answer {path} within {timeout:.0f} s") from None
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as err:  # refused, or cut mid-answer
            raise ServerError(f"the vLLM server at {self.url} cannot be reached for {path} "
                              f"({type(err).__name__}): is it still running?") from None
        if response.status_code not in ok:
            raise ServerError(f"the vLLM server at {self.url} answered {path} with {response.status_code}: "
                              f"{' '.join(response.text.split())[:300]}")
        return response

    def forget_earlier_runs(self) -> list[str]:
        """Unload the versions an earlier run of this run's scope left on the server (a re-run after an error, a
        resume); other runs' versions stay."""
        import requests

        try:
            listed = self.http.get(f"{self.url}/v1/models", timeout=CALL_TIMEOUT_S).json().get("data", [])
        except (requests.RequestException, ValueError) as err:
            raise ServerError(f"the vLLM server at {self.url} did not list its models: {err}") from None
        ours = [m["id"] for m in listed if str(m.get("id", "")).startswith(self.prefix)]
        for name in ours:
            self._call("/v1/unload_lora_adapter", {"lora_name": name}, ok=(200, 404))
            self._drop(name)  # its staged folder too: this run pushes the same names again
        return ours

    # -- the push ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def push(self, named, version=None, again: bool = False):
        """``again``: the same bytes as the last push (to a restarted server), not a new sync: what the checks
        verified is kept as it was. A server lost anywhere in the push (staging, loading, unloading the previous
        version) is waited for, its base compared again, and the version pushed to it whole under a new name."""
        named = list(named)
        for attempt in (1, 2):
            self._busy += 1
            try:
                return self._push_once(named, version, again)
            except ServerError as err:
                if attempt == 2 or not self._unreachable(err):
                    raise
            finally:
                self._busy -= 1
            self._wait_for_server()
            self._recheck_identity()

    def _push_once(self, named, version, again: bool):
        from safetensors.torch import save

        from .vllm_lora import check_complete, peft_to_vllm_name

        if self.closed:
            raise RuntimeError("LoRA push: this stream was closed (the run ended); a new run makes a new stream.")
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
        targets = sorted({k.rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in tensors})  # '...q_proj.lora_A.weight'
        self.push_count += 1
        name = f"{self.prefix}{self.push_count}"
        blob = save({f"base_model.model.{k}": v.contiguous() for k, v in tensors.items()})
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "use_rslora": False, "target_modules": targets,
                  "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model}
        folder = self._stage(name, blob, config)
        try:
            self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}, len(blob))
        except ServerError as err:  # the previous version keeps serving
            self._drop(name)
            if self._unreachable(err):
                raise
            raise ServerError(f"LoRA version {name!r} was not loaded: {err}") from None
        self.paths[name] = folder
        state = self.worker_state(keep_latest=True)
        previous, self.current = self.current, (name, version, state["id"])
        self.client.model = name  # every generate request asks for this version from now on
        self.pushes.append((name, version, state["id"]))
        self._labels = {n: v for n, v, _ in self.pushes}  # the recent versions' labels, to name a stale one
        self._id_labels = {i: v for _, v, i in self.pushes}  # and by the server's LoRA id, to name a misrouted slot
        if previous is not None:
            self._unload(previous[0])
        self._read = None
        if not again:
            self.last_sent = sent
        resident = state["resident"]
        if len(resident) > 1 or resident != [state["id"]]:
            raise RuntimeError(f"LoRA push: the server's workers hold LoRA ids {resident} after loading "
                               f"{state['id']}; they must serve the new version only.")
        return self.current

    def _stage(self, name: str, blob: bytes, config: dict) -> str:
        """Send ``blob`` to the server's workers in chunks; they stage it in their own folder and check its digest.
        Returns the folder on the server's machine (every worker must answer the same)."""
        size, digest = len(blob), hashlib.sha256(blob).hexdigest()
        for offset in range(0, max(size, 1), CHUNK_BYTES):
            chunk = blob[offset:offset + CHUNK_BYTES]
            answers = self._rpc("trl_fp8_stage_adapter", {"op": "chunk", "name": name, "offset": offset, "size": size,
                                                          "data": base64.b64encode(chunk).decode("ascii")}, len(chunk))
            note = next((a.get("note") for a in answers if a.get("note")), "")
            if note:
                print(f"trl_fp8: LoRA version {name}: {note}", file=sys.stderr, flush=True)
        answers = self._rpc("trl_fp8_stage_adapter", {"op": "commit", "name": name, "size": size, "sha256": digest,
                                                      "config": config}, size)
        paths = {a["path"] for a in answers}
        if len(paths) != 1:
            raise RuntimeError(f"the vLLM server's workers staged {name!r} under different folders {sorted(paths)}")
        return paths.pop()

    def _drop(self, name: str) -> None:
        try:
            self._rpc("trl_fp8_stage_adapter", {"op": "drop", "name": name})
        except ServerError:
            pass  # a server that no longer answers keeps nothing of this run after it exits (its folder is its own)
        self.paths.pop(name, None)

    def _unload(self, name: str) -> None:
        self._call("/v1/unload_lora_adapter", {"lora_name": name}, ok=(200, 404))
        self._drop(name)

    def _rpc(self, method: str, request: dict, nbytes: int = 0) -> list:
        response = self._call("/collective_rpc", {"method": method, "args": [json.dumps(request)]}, nbytes,
                              ok=(200, 400, 404, 500))
        if response.status_code == 404:
            raise ServerError(f"the vLLM server at {self.url} has no /collective_rpc route (start it with "
                              "VLLM_SERVER_DEV_MODE=1)")
        try:
            results = response.json().get("results")
        except ValueError:
            results = None
        if response.status_code != 200 or not results or any(isinstance(r, str) for r in results):
            said = results if results else " ".join(response.text.split())[:300]
            raise ServerError(f"the vLLM server at {self.url}: its workers did not answer {method} "
                              f"({response.status_code}: {said!s:.300}); a `trl-fp8 vllm-serve` server's do "
                              f"(--worker-extension-cls {WORKER_EXTENSION})")
        return results

    def worker_state(self, keep_latest: bool = False, names=None, digests: bool = False, routes: bool = False) -> dict:
        """What the server's workers hold (one answer per worker, which must agree): the newest LoRA id, the ids
        resident, and with ``names`` the newest version's factors under those PEFT names as its LoRA kernels read
        them (its slot buffers), or with ``digests`` their digests only; with ``routes`` the tokens computed since
        the last such request against their requests' slots (:mod:`trl_fp8._trl.vllm_routing`, every worker's)."""
        request = {"keep_latest": keep_latest, "names": list(names or ()), "adapter": self.spec.adapter,
                   "digests": digests, "watch_routes": self._watch_routes, "routes": routes}
        try:
            results = self._rpc("trl_fp8_lora_state", request)
        except ServerError as err:
            # a server lost between pushes (under the checks' read-back, the digests after a generation): waited for,
            # compared again and pushed the current version, then asked again. Inside a push or a restart the
            # error goes to them (they retry as a whole).
            if not self._unreachable(err) or self._busy or self.current is None:
                raise
            self._after_restart(None)
            results = self._rpc("trl_fp8_lora_state", request)
        first = results[0]
        if any(r["id"] != first["id"] or r["resident"] != first["resident"] for r in results[1:]):
            raise RuntimeError(f"the vLLM server's workers disagree on the LoRA versions they hold: {results!r:.300}")
        if routes:
            from .vllm_routing import merge

            first["routes"] = merge(r.get("routes") for r in results)
        return first

    def read_back(self) -> dict[str, torch.Tensor]:
        """The current version's factors as the server's LoRA kernels read them (its workers' slot buffers), by PEFT
        name: read once per round of checks (:meth:`forget`), never kept per version name — a reload in place keeps
        the name and changes the content."""
        if self.current is None:
            return {}
        if self._read is None:
            state = self.worker_state(names=list(self.last_sent))
            if state["id"] != self.current[2] and not state["resident"] and not self._busy:
                # a server that restarted between the push and this read (and came back before anything noticed)
                # holds no version: it is pushed the current one again, then read
                self._after_restart(None)
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
        state = self.worker_state(names=list(names), digests=True, routes=self._watch_routes)
        self._routes_taken = state.get("routes")
        if state["id"] != self.current[2]:
            return {n: f"the server's newest LoRA id {state['id']}, not {self.current[2]}" for n in names}
        return state["digests"]

    def watch_routes(self) -> None:
        self._watch_routes = True  # the workers install their guard at the next state request (the first push's)

    def routes(self):
        if not self._watch_routes or self.current is None:
            return None
        taken, self._routes_taken = self._routes_taken, None
        return taken if taken is not None else self.worker_state(routes=True)["routes"]

    def label_of(self, lora_id):
        return self._id_labels.get(lora_id)

    def identity(self, names) -> dict:
        """The served identity of the server's base under the learner's names
        (:func:`trl_fp8.engine_weights.engine_identity`, computed by every worker, which must agree)."""
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
            self._id_labels[self.current[2]] = version

    # -- the client's side -----------------------------------------------------------------------------------------
    def _hook_client(self) -> None:
        client, post = self.client, self.client._post
        recording = []

        def observed_post(url, **kwargs):
            if not (recording and url.endswith("/v1/completions")):
                return post(url, **kwargs)
            kwargs.setdefault("timeout", GENERATE_TIMEOUT_S)
            try:
                response = post(url, **kwargs)
            except Exception as err:  # noqa: BLE001 - TRL's client raises a bare Exception on a non-200 answer
                if not self._server_lost(err):
                    raise
                self._after_restart(kwargs.get("json", {}).get("model"))
                kwargs["json"] = {**kwargs["json"], "model": self.client.model}
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

    # -- a server that restarts -----------------------------------------------------------------------------------
    def _server_lost(self, err: Exception) -> bool:
        """Whether a generate request failed because the server lost the run's version (it restarted: 404 "does not
        exist") or cannot be reached (it is restarting)."""
        import requests

        text = str(err)
        if isinstance(err, (requests.ConnectionError, requests.Timeout)) or "Max retries exceeded" in text:
            return True
        return "404" in text and "does not exist" in text and self.current is not None and \
            self.current[0] in text

    @staticmethod
    def _unreachable(err: Exception) -> bool:
        return "cannot be reached" in str(err) or "did not answer /" in str(err)

    def _wait_for_server(self) -> None:
        """Wait for the server to answer ``/health`` again (:data:`RESTART_WAIT_S`), else stop in one line."""
        import time

        import requests

        wait = restart_wait()
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                if self.http.get(f"{self.url}/health", timeout=10).status_code == 200:
                    if said:
                        print(f"trl_fp8: the vLLM server at {self.url} is back", file=sys.stderr, flush=True)
                    return
            except requests.RequestException:
                pass
            if not said:
                print(f"trl_fp8: the vLLM server at {self.url} stopped answering; waiting for it (up to "
                      f"{wait:.0f} s)", file=sys.stderr, flush=True)
                said = True
            if time.monotonic() > deadline:
                raise ServerGone(f"the vLLM server at {self.url} stopped answering and did not come back within "
                                 f"{wait:.0f} s: start it again, then resume the run with "
                                 "--resume_from_checkpoint auto")
            time.sleep(2)

    @contextlib.contextmanager
    def _handling(self):
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1

    def _recheck_identity(self) -> None:
        """A server that restarted may have come back on another checkpoint (another --model, --dtype, 4-bit or
        not): its base is compared with the learner's again before anything is pushed to it (the check raises)."""
        if self.identity_recheck is not None:
            self.identity_recheck()

    def _after_restart(self, asked: str | None) -> None:
        """The server restarted (or is restarting): wait for it (:data:`RESTART_WAIT_S`), then push the current
        version to it again under a new name with the same label — the bytes the checks verified — so the step's
        rollouts are generated again with it. Many generate threads may meet the loss at once: one pushes."""
        import threading

        lock = self.__dict__.setdefault("_restart_lock", threading.Lock())
        with lock, self._handling():
            if self.current is not None and asked is not None and asked != self.current[0]:
                return  # another thread pushed it again already
            self._wait_for_server()
            if self.current is not None and self.current[2] is not None and \
                    self.current[2] in self.worker_state()["resident"]:
                raise ServerError(f"the vLLM server at {self.url} stopped serving adapter version "
                                  f"{self.current[0]!r} while its workers still hold it: another client unloaded it "
                                  "(/v1/unload_lora_adapter) under a rollout — a restarted server holds no version. "
                                  "Let one run own its versions on a server")
            self._recheck_identity()  # a restarted server: the base it came back with, before the version goes to it
            label = None if self.current is None else self.current[1]
            print(f"trl_fp8: the vLLM server at {self.url} restarted; pushing adapter version {label} to it again",
                  file=sys.stderr, flush=True)
            self.current = None if self.current is None else (self.current[0], label, None)
            self.restarts = getattr(self, "restarts", 0) + 1
            self.push(list(self.last_sent.items()), label, again=True)

    def close(self) -> None:
        """Forget the current version on the server and have its folder removed (the server keeps serving its base);
        the stream then refuses pushes."""
        self.closed = True
        if self.current is not None:
            try:
                self._unload(self.current[0])
            except Exception:  # noqa: BLE001 - the server may be gone at exit; its folders are its own
                pass
            self.current = None
