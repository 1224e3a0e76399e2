"""Every notebook in notebooks/ runs top to bottom (nbclient, a kernel on this very Python) and is committed without
outputs. The kernel inherits this session's environment (tests/conftest.py: 8 simulated CPU devices, CPU platform,
the shared persistent compilation cache)."""

import json
import pathlib
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300
KERNEL = "jaxinfer-test-python"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec that starts ipykernel on sys.executable (not whatever "python3" resolves to on this machine)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxinfer tests", "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))
        yield KERNEL


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_meshes_and_experts.ipynb", "03_kernels.ipynb",
                                           "04_sweep.ipynb", "05_speculative_decoding.ipynb", "06_plan.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_name):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the cell and its traceback) when a cell fails
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
