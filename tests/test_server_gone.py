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
