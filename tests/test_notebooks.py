"""The numerics notebooks (examples/notebooks/) run top to bottom at their default sizes.

Each is executed with nbclient in a fresh python3 kernel of this interpreter (JUPYTER_PATH puts
this environment's kernel spec first; jupyter_client runs its "python" as sys.executable), in a
temporary directory (their figures land there, not in the repository), with this checkout on
PYTHONPATH; a cell that raises fails the test.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from tests.cpu_subprocess import child_env

WHY = "the notebook runner is missing: pip install -e '.[test]' installs nbclient and nbformat"
nbformat = pytest.importorskip("nbformat", reason=WHY)
NotebookClient = pytest.importorskip("nbclient", reason=WHY).NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "notebooks"
CELL_TIMEOUT_S = 600


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["sparse_mla_numerics", "ultraquant_accuracy", "mla_decode_splits"]
)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(pathlib.Path(sys.prefix) / "share" / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])  # the kernel imports this checkout
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    figures = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "image/png" in out.get("data", {})
    ]
    saved = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
    assert figures, f"{name}: no figure was drawn"
    assert len(saved) == len(figures), f"{name}: {len(figures)} figures drawn, saved {saved}"
