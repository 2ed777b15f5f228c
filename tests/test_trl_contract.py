"""The contract with TRL: every private TRL name trl_fp8 relies on (listed in ``trl_fp8._trl``) is still there, with
the same signature, and every TRL code block whose internals we depend on is unchanged. A TRL upgrade that moves
any of them fails here with the list of what moved — not later, silently, in a training run."""

import inspect
import json

import pytest
from trl import GRPOTrainer as TRLGRPOTrainer

import trl_fp8
from trl_fp8 import _trl

# sha256[:16] of the source of each block in _trl.MIRRORED, as of the tested TRL (see _trl.TESTED_TRL).
FINGERPRINTS = {
    "trl.trainer.grpo_trainer.GRPOTrainer._generate_single_turn": "8d066ab0cfcce8fa",
    "trl.trainer.grpo_trainer.GRPOTrainer._generate_and_score_completions": "b326370a0a956b60",
    "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss": "46299536a65d11c4",
    "trl.trainer.grpo_trainer.GRPOTrainer.log": "109598e7cb234198",
    "trl.trainer.utils.add_fused_lm_head": "c309684c7d7599a8",
    "trl.generation.vllm_generation.VLLMGeneration._iter_named_params": "2d382cc98ed2cf89",
    "trl.generation.vllm_generation.VLLMGeneration.sync_weights": "853d90c2502df41c",
    "trl.generation.vllm_generation.VLLMGeneration._init_vllm": "89e22930922d1fc5",
    "trl.generation.vllm_generation.VLLMGeneration.generate": "d938ebcbfbc5bcd9",
    "transformers.trainer.Trainer._maybe_log_save_evaluate": "601752c0cc87e581",
    "trl.trainer.utils.RepeatSampler.__iter__": "704f9ff00e675174",
    "transformers.trainer.Trainer._save_checkpoint": "125450cf16a80a9f",
    "transformers.trainer.Trainer._push_from_checkpoint": "c27a9586e6eebfdc",
    "trl.trainer.grpo_trainer.GRPOTrainer._save_checkpoint": "4d94a082195a2a00",
    "trl.trainer.grpo_trainer.GRPOTrainer._prepare_inputs": "f763f61274781c51",
}
# Other TRL callables trl_fp8 calls, with the parameters it passes.
CALLED = {
    "trl.trainer.utils.add_fused_lm_head": ("model", "temperature", "cast_lm_head_to_fp32", "outputs"),
    "trl.generation.vllm_generation.VLLMGeneration._fix_param_name_to_vllm": ("self", "name"),
    "trl.generation.vllm_generation.VLLMGeneration.sync_weights": ("self",),
    "trl.generation.vllm_generation.VLLMGeneration._iter_named_params": ("self",),
    "trl.cli.accelerate_config.resolve_accelerate_config_argument": ("launch_args",),
    "trl.cli.commands.training._subtract_subsequence": ("lst", "subseq"),
    # checkpoints (trl_fp8.checkpoints through _trl.write_checkpoint_files and friends)
    "transformers.trainer.Trainer.save_model": ("self", "output_dir", "_internal_call"),
    "transformers.trainer.Trainer._save_optimizer_and_scheduler": ("self", "output_dir"),
    "transformers.trainer.Trainer._save_scaler": ("self", "output_dir"),
    "transformers.trainer.Trainer._save_rng_state": ("self", "output_dir"),
    "transformers.trainer.Trainer._push_from_checkpoint": ("self", "checkpoint_folder"),
    "transformers.trainer.Trainer._load_from_checkpoint": ("self", "resume_from_checkpoint"),
    "transformers.trainer.Trainer._get_output_dir": ("self", "trial"),
    "transformers.trainer.Trainer.store_flos": ("self",),
    "transformers.trainer_callback.TrainerState.save_to_json": ("self", "json_path"),
    "transformers.trainer_utils.sort_checkpoints": ("output_dir", "checkpoint_prefix", "use_mtime"),
    "trl.trainer.base_trainer._BaseTrainer.create_model_card": ("self", "model_name"),
}


def test_the_installed_trl_is_in_the_tested_range():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    import trl

    assert Version(trl.__version__) in SpecifierSet(_trl.TESTED_TRL), (trl.__version__, _trl.TESTED_TRL)


def test_overridden_methods_keep_their_signatures():
    moved = []
    for name, expected in _trl.OVERRIDDEN.items():
        method = getattr(TRLGRPOTrainer, name, None)
        if method is None:
            moved.append(f"{name}: gone from trl.GRPOTrainer")
            continue
        params = tuple(inspect.signature(method).parameters)
        if params != expected:
            moved.append(f"{name}: {params} (expected {expected})")
    assert not moved, "TRL methods trl_fp8 overrides changed:\n" + "\n".join(moved)


def test_we_override_only_what_the_contract_lists():
    ours = {name for name, value in vars(trl_fp8.GRPOTrainer).items()
            if callable(value) and hasattr(TRLGRPOTrainer, name) and not name.startswith("__")}
    assert ours == set(_trl.OVERRIDDEN), sorted(ours ^ set(_trl.OVERRIDDEN))


def test_called_trl_functions_keep_their_parameters():
    moved = []
    for qualname, expected in CALLED.items():
        params = tuple(inspect.signature(_trl.resolve(qualname)).parameters)
        missing = [p for p in expected if p not in params]
        if missing:
            moved.append(f"{qualname}: no parameter(s) {missing} in {params}")
    assert not moved, "\n".join(moved)


def test_mirrored_trl_code_is_unchanged():
    assert set(FINGERPRINTS) == set(_trl.MIRRORED)
    moved = [f"{qualname}: fingerprint {_trl.fingerprint(qualname)} (pinned {pinned}) — we rely on: "
             f"{_trl.MIRRORED[qualname]}" for qualname, pinned in FINGERPRINTS.items()
             if _trl.fingerprint(qualname) != pinned]
    assert not moved, ("TRL code whose internals trl_fp8 depends on changed; re-read it, adapt trl_fp8/_trl/, then "
                       "re-pin:\n" + "\n".join(moved))


def test_a_constructed_trainer_has_every_attribute_we_read(tmp_path, demo_dir):
    from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

    args = trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    trainer = trl_fp8.GRPOTrainer(model=demo_dir, reward_funcs=[correctness_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(8, seed=0))
    missing = [a for a in _trl.TRAINER_ATTRIBUTES if not hasattr(trainer, a)]
    assert not missing, f"TRL no longer sets {missing}"
    assert set(trainer._metrics) == {"train", "eval"} and trainer._metrics["train"]["x"] == []  # defaultdict(list)
    assert isinstance(_trl.num_beams(trainer), int)


def test_every_site_outside_trl_that_reads_a_trl_private_trainer_name_is_listed():
    import re
    from pathlib import Path

    import transformers.trainer
    import trl.trainer.grpo_trainer

    # a private name TRL's or transformers' trainer sets or defines (trl_fp8's own, e.g. _step_boundary, are not)
    theirs = inspect.getsource(trl.trainer.grpo_trainer) + inspect.getsource(transformers.trainer)
    root = Path(trl_fp8.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where.startswith("_trl/"):
            continue
        for name in re.findall(r"\btrainer\.(_[A-Za-z]\w*)", path.read_text()):
            if re.search(rf"self\.{name}\b|def {name}\(", theirs):
                found.setdefault(where, set()).add(name)
    assert found == {where: set(names) for where, names in _trl.PRIVATE_READERS.items()}, found
    unpinned = {n for names in _trl.PRIVATE_READERS.values() for n in names} - set(_trl.TRAINER_ATTRIBUTES)
    assert not unpinned, f"read outside _trl but not in TRAINER_ATTRIBUTES: {sorted(unpinned)}"


def test_vllm_attributes_are_still_set_by_trl():
    # read from TRL's source: building a vLLM engine needs the vllm environment (tests/sync_checks/test_vllm_engine.py)
    from trl.generation.vllm_generation import VLLMGeneration

    sources = {"GRPOTrainer": inspect.getsource(TRLGRPOTrainer.__init__),
               "VLLMGeneration": inspect.getsource(VLLMGeneration)}
    missing = [f"{owner}.{attr}" for owner, attrs in _trl.VLLM_ATTRIBUTES.items() for attr in attrs
               if f"self.{attr} =" not in sources[owner]]
    assert not missing, f"TRL no longer sets {missing}"


@pytest.mark.vllm  # runs in .venv-vllm (`make test-vllm`, `-m vllm`)
def test_patched_module_globals_exist():
    vllm = pytest.importorskip("vllm")
    assert vllm
    moved = []
    for qualname in _trl.PATCHED_GLOBALS:
        module, _, attr = qualname.rpartition(".")
        try:
            _trl.resolve(qualname)
        except (ImportError, AttributeError):
            moved.append(f"{module} has no {attr}")
    assert not moved, moved


@pytest.mark.vllm  # runs in .venv-vllm (`make test-vllm`, `-m vllm`)
def test_the_vllm_engine_calls_of_duet_exist():
    # trl_fp8.duet.vllm steps a colocated engine itself (through _trl.vllm_add_request / vllm_step / vllm_abort and
    # vllm_delta_params); the real-engine tests (tests/duet/test_vllm.py) run them
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    moved = []
    for name, expected in {"add_request": ("self", "request_id", "prompt", "params"), "step": ("self",),
                           "abort_request": ("self", "request_ids")}.items():
        params = tuple(inspect.signature(getattr(LLMEngine, name)).parameters)[:len(expected)]
        if params != expected:
            moved.append(f"LLMEngine.{name}{params} (expected {expected})")
    assert not moved, moved
    assert SamplingParams(n=1, logprobs=2, output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA


def test_trl_s_vllm_range_notice_is_quiet_for_the_tested_version_only():
    """TRL warns about any vLLM above 0.31.0; trl_fp8 is tested on 0.32 and quiets that notice for 0.32.x alone. In a
    fresh process (pytest restores its warning filters after collecting, dropping what an import installed)."""
    import subprocess
    import sys

    code = """
import json, warnings
import trl_fp8
import trl.import_utils as iu
out = {}
for version in ("0.32.0", "0.32.3", "0.33.0", "0.21.0"):
    iu._is_package_available = lambda name, return_version=False, v=version: (True, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message="TRL currently supports vLLM", append=True)
        iu.is_vllm_available()
    out[version] = sum("TRL currently supports vLLM" in str(w.message) for w in caught)
print("NOTICES", json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    notices = json.loads(done.stdout.rsplit("NOTICES", 1)[1])
    assert notices == {"0.32.0": 0, "0.32.3": 0, "0.33.0": 1, "0.21.0": 1}
