"""The Colab and Kaggle notebooks (examples/notebooks): clean files, and they run and resume.

Each notebook is executed twice with nbclient on a kernel that is this venv's own Python, with its parameters cell
overridden as papermill does (an ``injected-parameters`` cell right after the cell tagged ``parameters``): smoke mode
(no install, no Drive, the embedded demo model and task, fast QLoRA over a 4-bit base and Fair Cast on the CPU),
2 steps with a checkpoint at step 2, then the same notebook again with 4 steps. The second execution must resume
from the first's checkpoint: it trains steps 2 -> 4, and the run's metrics.jsonl holds steps 1..4 once each.

The notebooks use ``time_budget``, ``precision="auto"`` and ``resume_from_checkpoint="auto"`` (trl_fp8/time_budget,
trl_fp8/precision.py, trl_fp8/checkpoints.py): without them the executions fail
(``test_the_notebooks_config_fields_exist`` says which are missing).
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / "examples" / "notebooks"
NOTEBOOKS = ("colab_grpo.ipynb", "kaggle_grpo.ipynb")
KERNEL = "trl_fp8_test_venv"
SESSION_LINE = re.compile(r"This session trained steps (\d+) -> (\d+) of (\d+)\.")


def _load(name):
    return nbformat.read(FOLDER / name, as_version=4)


def _parameters_cell(nb):
    code = [c for c in nb.cells if c.cell_type == "code"]
    return code[0]


# -- the files ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_file_is_valid_clean_and_parameterised(name):
    nb = _load(name)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "commit notebooks with outputs cleared"
    params = _parameters_cell(nb)
    assert "parameters" in params.metadata.get("tags", []), "the first code cell is the papermill parameters cell"
    namespace = {}
    exec(params.source, namespace)  # plain assignments only
    assert namespace["SMOKE"] is False and namespace["INSTALL"] is True
    for key in ("OUTPUT_DIR", "MAX_STEPS", "SAVE_STEPS", "TIME_BUDGET", "MODEL_ID", "REPORT_TO", "TRL_FP8_PIP"):
        assert key in namespace
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for needle in ('resume_from_checkpoint="auto"', "time_budget=TIME_BUDGET", 'fair_cast="stochastic"',
                   'fast_qlora="auto"', "load_in_4bit=True", "LoraConfig(", "from trl_fp8 import GRPOConfig, GRPOTrainer",
                   "plot_metrics("):
        assert needle in source, f"{name} lacks {needle}"
    if name.startswith("colab"):
        assert "drive.mount(" in source and namespace["OUTPUT_DIR"].startswith("/content/drive/")
    else:
        assert namespace["OUTPUT_DIR"].startswith("/kaggle/working/")


def test_notebooks_are_the_generators_output():
    sys.path.insert(0, str(FOLDER))
    try:
        import make_notebooks
    finally:
        sys.path.remove(str(FOLDER))
    for platform, spec in make_notebooks.PLATFORMS.items():
        assert (FOLDER / spec["file"]).read_text(encoding="utf-8") == make_notebooks.render(platform), (
            f"{spec['file']} differs from examples/notebooks/make_notebooks.py: edit the generator and rerun it")


def test_the_notebooks_config_fields_exist():
    """The notebooks are written against time_budget, precision="auto" and resume_from_checkpoint="auto"."""
    from dataclasses import fields

    from trl_fp8 import GRPOConfig

    names = {f.name for f in fields(GRPOConfig)}
    missing = [n for n in ("time_budget", "precision") if n not in names]
    assert not missing, f"GRPOConfig lacks {missing}: the notebooks cannot run without them"
    import importlib.util

    assert importlib.util.find_spec("trl_fp8.checkpoints") is not None, (
        "trl_fp8/checkpoints.py (resume_from_checkpoint='auto') is not in this tree: the notebooks' second execution "
        "cannot resume")


# -- executing them -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernelspec whose kernel is this interpreter (the venv's python), offline and single-threaded."""
    folder = tmp_path_factory.mktemp("kernels")
    spec = folder / KERNEL
    spec.mkdir()
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TRL_FP8_CACHE": os.environ.get("TRL_FP8_CACHE", str(folder / "kernel_cache")), "MPLBACKEND": "Agg"}
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "trl_fp8 test venv", "language": "python", "env": env,
    }))
    return folder


def execute(name, params: dict, kernel_dir, cwd):
    """Execute notebook ``name`` with ``params`` injected after its parameters cell; return the executed notebook."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = _load(name)
    index = nb.cells.index(_parameters_cell(nb))
    injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()),
                                         metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, injected)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = NotebookClient(nb, km=km, kernel_name=KERNEL, timeout=900, startup_timeout=120,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                out.append(output.get("text", ""))
            elif "data" in output:
                out.append(output["data"].get("text/plain", ""))
    return "".join(out)


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_then_resumes_from_its_own_checkpoint(name, kernel_dir, tmp_path):
    out = tmp_path / "run"
    params = dict(SMOKE=True, INSTALL=False, OUTPUT_DIR=str(out), SAVE_STEPS=2, TIME_BUDGET="1h", REPORT_TO="none")

    first = execute(name, {**params, "MAX_STEPS": 2}, kernel_dir, tmp_path)
    assert SESSION_LINE.findall(_text(first)) == [("0", "2", "2")]
    assert (out / "checkpoint-2").is_dir() and (out / "final_adapter").is_dir()
    assert _images(first) >= 1, "the plots are shown inline"

    second = execute(name, {**params, "MAX_STEPS": 4}, kernel_dir, tmp_path)
    assert SESSION_LINE.findall(_text(second)) == [("2", "4", "4")], "the second execution resumes at step 2"
    assert (out / "checkpoint-4").is_dir()
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4], "metrics.jsonl continues the run: each step once"
    assert _images(second) >= 1
