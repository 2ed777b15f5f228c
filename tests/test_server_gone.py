"""A vLLM server that stops answering and does not come back stops the run inside a step, before its optimizer
update: the trainer saves the last complete step's checkpoint first (as on SIGTERM), so a resume once the server
runs again loses nothing. Before, the run ended with the error and everything since the last checkpoint was lost."""

import os

import pytest

import trl_fp8
from trl_fp8._trl.vllm_server_lora import ServerGone
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset


def _trainer(tmp_path, model_dir, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=6, learning_rate=1e-3,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=7)
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(64, seed=5))


def test_a_server_that_never_returns_saves_the_last_complete_step(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir)
    generate, calls = trainer._generate_single_turn, []

    def gone_at_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # step 3's rollouts: the server was lost and did not come back
            raise ServerGone("the vLLM server at http://127.0.0.1:1 stopped answering and did not come back within "
                             "300 s: start it again, then resume the run with --resume_from_checkpoint auto")
        return generate(*args, **kwargs)

    trainer._generate_single_turn = gone_at_the_third
    with pytest.raises(ServerGone, match="did not come back"):
        trainer.train()
    assert trainer.state.global_step == 2
    saved = os.path.join(trainer.args.output_dir, "checkpoint-2")
    assert os.path.isdir(saved), os.listdir(trainer.args.output_dir)
    assert trl_fp8.checkpoints.check_complete(saved).complete
    again = _trainer(tmp_path, tiny_model_dir, max_steps=3)
    again.train(resume_from_checkpoint="auto")  # the resume carries on from step 2
    assert again.state.global_step == 3


def test_another_server_error_saves_nothing(tmp_path, tiny_model_dir):
    from trl_fp8._trl.vllm_server_lora import ServerError

    trainer = _trainer(tmp_path, tiny_model_dir)
    generate, calls = trainer._generate_single_turn, []

    def refused(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ServerError("LoRA version 'x' was not loaded: 400")
        return generate(*args, **kwargs)

    trainer._generate_single_turn = refused
    with pytest.raises(ServerError, match="was not loaded"):
        trainer.train()
    assert not [n for n in os.listdir(trainer.args.output_dir) if n.startswith("checkpoint-")]


def test_the_stream_gives_up_on_a_server_after_its_wait_with_server_gone(monkeypatch, capsys):
    import requests

    from trl_fp8._trl import vllm_server_lora as vsl

    class Down:
        def get(self, url, timeout):
            raise requests.ConnectionError("connection refused")

    stream = vsl.VLLMServerLoraStream.__new__(vsl.VLLMServerLoraStream)
    stream.url, stream.http = "http://127.0.0.1:1", Down()
    monkeypatch.setattr(vsl, "RESTART_WAIT_S", 0.0)
    with pytest.raises(ServerGone, match=r"stopped answering and did not come back within 0 s: start it again, "
                                         r"then resume the run with --resume_from_checkpoint auto"):
        stream._wait_for_server()
    assert "stopped answering; waiting for it" in capsys.readouterr().err


def test_the_wait_is_read_when_a_server_is_lost_and_a_bad_value_is_refused_by_name(monkeypatch):
    from trl_fp8._trl import vllm_server_lora as vsl

    monkeypatch.setenv("TRL_FP8_SERVER_WAIT_S", "20")
    assert vsl.restart_wait() == 20.0
    monkeypatch.delenv("TRL_FP8_SERVER_WAIT_S")
    assert vsl.restart_wait() == vsl.RESTART_WAIT_S == 300.0
    monkeypatch.setenv("TRL_FP8_SERVER_WAIT_S", "soon")
    with pytest.raises(ValueError, match=r"\$TRL_FP8_SERVER_WAIT_S='soon': give the seconds"):
        vsl.restart_wait()


class _FakeServer:
    """A `trl-fp8 vllm-serve` server as the stream's calls see it: its workers stage, load and hold one LoRA id; the
    connection of one chosen call is cut mid-answer (the server killed), after which it is a fresh server."""

    def __init__(self, cut: str):
        self.cut, self.calls, self.ids, self.resident, self.loaded = cut, [], 0, [], {}

    def get(self, url, timeout):
        class Ok:
            status_code = 200
        return Ok()

    def post(self, url, json, timeout):
        import json as _json

        import requests

        path = url.split("127.0.0.1:1", 1)[1]
        method = _json.loads(json["args"][0]) if path == "/collective_rpc" else None
        what = path if method is None else f"{json['method']}:{method.get('op', '')}"
        self.calls.append(what)
        if what == self.cut:
            self.cut = None
            self.ids, self.resident, self.loaded = 100, [], {}  # killed; it comes back with nothing loaded
            raise requests.exceptions.ChunkedEncodingError("Connection broken: IncompleteRead(0 bytes read)")
        results = None
        if path == "/v1/load_lora_adapter":
            self.ids += 1
            self.loaded[json["lora_name"]] = self.ids
            self.resident = [self.ids]
        elif path == "/v1/unload_lora_adapter":
            self.loaded.pop(json["lora_name"], None)
        elif json["method"] == "trl_fp8_stage_adapter":
            results = [{"path": f"/srv/{method['name']}"} if method["op"] == "commit" else {}]
        elif json["method"] == "trl_fp8_lora_state":
            from trl_fp8._trl.vllm_server_lora import encode_tensor

            import torch

            results = [{"id": self.ids, "resident": list(self.resident),
                        "tensors": {n: encode_tensor(torch.zeros(2, 2)) for n in method.get("names", [])}}]
        answer = {"results": results} if results is not None else {}

        class Response:
            status_code = 200
            text = ""

            def json(self):
                return answer
        return Response()


NAMES = ["base_model.model.layers.0.q_proj.lora_A.default.weight",
         "base_model.model.layers.0.q_proj.lora_B.default.weight"]


def _stream_to_a_fake_server():
    """A server adapter stream talking to a :class:`_FakeServer`; ``rechecked`` records each identity re-check."""
    import collections
    import types

    import torch

    from trl_fp8._trl import vllm_server_lora as vsl

    stream = vsl.VLLMServerLoraStream.__new__(vsl.VLLMServerLoraStream)
    server = _FakeServer(None)
    stream.url, stream.http, stream.prefix, stream.dtype = "http://127.0.0.1:1", server, "trl_fp8-ab12-v", torch.float32
    stream.base_model, stream.client = "m", types.SimpleNamespace(model="m")
    stream.spec = types.SimpleNamespace(adapter="default", rank=2)
    stream.current, stream.paths, stream.closed, stream._labels, stream._read = None, {}, False, {}, None
    stream._id_labels, stream._watch_routes, stream._routes_taken = {}, True, None
    stream.pushes, stream.push_count, stream.last_sent, stream._busy = collections.deque(maxlen=8), 0, {}, 0
    rechecked = []
    stream.identity_recheck = lambda: rechecked.append(True)
    return stream, server, rechecked


@pytest.mark.parametrize("cut", ["/v1/unload_lora_adapter", "trl_fp8_stage_adapter:drop", "/v1/load_lora_adapter",
                                 "trl_fp8_stage_adapter:commit", "trl_fp8_lora_state:"])
def test_a_server_killed_anywhere_in_a_push_is_waited_for_compared_again_and_pushed_the_version_whole(cut, capsys):
    """The connection cut mid-answer (requests' ChunkedEncodingError: it escaped the stream as a traceback when the
    server was killed while the previous version was being dropped) — at each call of a push: the stream waits for the
    server, compares its base again, and pushes the same version to it whole under a new name."""
    import torch

    stream, server, rechecked = _stream_to_a_fake_server()
    names = NAMES
    first = [(n, torch.full((2, 2), 1.0)) for n in names]
    second = [(n, torch.full((2, 2), 2.0)) for n in names]
    stream.push(iter(first), 1)
    assert stream.current[0] == "trl_fp8-ab12-v1" and not rechecked
    server.cut = cut  # killed under the second push
    name, label, lora_id = stream.push(iter(second), 2)
    assert cut in server.calls
    if cut == "trl_fp8_stage_adapter:drop":  # the new version was loaded: nothing to redo in the push (a server
        assert name == "trl_fp8-ab12-v2" and not rechecked  # that died there fails the next generate: restart path)
        return
    assert rechecked == [True]  # the base of the server that came back, compared before the version went to it
    assert label == 2 and name == "trl_fp8-ab12-v3" and server.loaded == {name: lora_id} and server.resident == [lora_id]
    assert torch.equal(stream.last_sent[names[0]], torch.full((2, 2), 2.0))
    assert "stopped answering" not in capsys.readouterr().err  # it answered /health at once


def test_a_server_lost_under_the_checks_read_back_is_pushed_the_version_again_and_read(capsys):
    """Killed between pushes — under the checks' read-back of the slots or the digests after a generation: the read
    waits for the server, compares its base again, pushes the current version (the bytes the checks verified, same
    label) and reads the new server. (It stopped the run with "cannot be reached for /collective_rpc" before.)"""
    import torch

    stream, server, rechecked = _stream_to_a_fake_server()
    names = NAMES
    stream.push(iter([(n, torch.full((2, 2), 1.0)) for n in names]), 7)
    server.cut = "trl_fp8_lora_state:"
    state = stream.worker_state()
    assert rechecked == [True] and stream.current[1] == 7 and stream.current[0] == "trl_fp8-ab12-v2"
    assert state["id"] == stream.current[2] and server.resident == [state["id"]]
    assert "restarted; pushing adapter version 7 to it again" in capsys.readouterr().err


def test_a_server_that_does_not_answer_its_configuration_is_said_in_one_line_not_waited_for_forever():
    """TRL's client asks /server_info without a timeout (a wedged server held the trainer there for ever): the
    stream asks with its call timeout and says which server did not answer what."""
    import types

    import requests

    from trl_fp8._trl import vllm_server_lora as vsl

    asked = []

    class Wedged:
        def get(self, url, params=None, timeout=None):
            asked.append(timeout)
            raise requests.Timeout("read timed out")

    generation = types.SimpleNamespace(vllm_client=types.SimpleNamespace(base_url="http://127.0.0.1:1", model="m"))
    with pytest.raises(vsl.ServerError, match=r"the vLLM server at http://127.0.0.1:1 did not answer /server_info "
                                              r"within 60 s"):
        vsl.VLLMServerLoraStream(generation, lambda: iter(()), types.SimpleNamespace(adapter="default", rank=2),
                                 http=Wedged())
    assert asked == [vsl.CALL_TIMEOUT_S]


def test_a_server_that_restarted_between_the_push_and_the_read_back_is_pushed_again_then_read(capsys):
    """The server restarted and came back before any call failed: the read-back finds a fresh server (a newer id
    counter, no version resident) and pushes the current version to it again before reading, instead of stopping."""
    import torch

    stream, server, rechecked = _stream_to_a_fake_server()
    names = NAMES
    stream.push(iter([(n, torch.full((2, 2), 1.0)) for n in names]), 3)
    server.ids, server.resident, server.loaded = 100, [], {}  # restarted: a fresh server, nothing loaded
    read = stream.read_back()
    assert sorted(read) == sorted(names) and rechecked == [True]
    assert stream.current[0] == "trl_fp8-ab12-v2" and stream.current[1] == 3 and server.resident == [stream.current[2]]
