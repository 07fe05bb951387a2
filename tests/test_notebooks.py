"""Every notebook in `notebooks/` runs top to bottom without an error.

Each `notebooks/*.ipynb` (found by glob, so a new notebook is picked up by itself) is copied
into a temporary directory and executed there with nbclient, cell by cell, on a Jupyter
kernel that runs this interpreter (`sys.executable`, so the kernel sees the same
environment and the grpojax under test, whatever kernelspecs the machine has installed). A
cell that raises, or runs past `CELL_TIMEOUT_S`, fails the test; the worked numbers the
notebooks compute are asserted in their cells, so a wrong number fails it too. The
committed file is never rewritten by the test.

To refresh a notebook's committed outputs after editing it (executed the same way, then
written back):

    python tests/test_notebooks.py notebooks/01_ops_from_the_seeds.ipynb [...]
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell; the notebooks take seconds to a minute or two in all
KERNEL = "grpojax-this-python"

# The notebooks train and compile (tens of seconds each): run them among the first tests.
pytestmark = pytest.mark.slow


def _kernel_manager(workdir: pathlib.Path) -> KernelManager:
    """A kernel manager whose only kernelspec runs ipykernel on `sys.executable`.

    The default "python3" spec resolves to whatever a machine has installed (a user or
    system kernelspec may point at another Python); this one cannot."""
    spec_dir = workdir / ".kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (grpojax tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)


def execute(path: pathlib.Path, workdir: pathlib.Path) -> tuple[nbformat.NotebookNode, float]:
    """Runs a copy of the notebook `path` in `workdir` (its working directory, where it may
    write files); returns the executed notebook and the wall time in seconds. Raises
    `nbclient.exceptions.CellExecutionError` on the first cell that fails."""
    copy = workdir / path.name
    shutil.copyfile(path, copy)
    nb = nbformat.read(copy, as_version=4)
    client = NotebookClient(
        nb,
        km=_kernel_manager(workdir),
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        record_timing=False,
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.perf_counter()
    client.execute()
    return nb, time.perf_counter() - start


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    before = path.read_bytes()
    nb, seconds = execute(path, tmp_path)
    print(f"{path.name}: executed in {seconds:.1f} s")
    assert path.read_bytes() == before, "the committed notebook was rewritten"
    # Committed with outputs, and nothing in them is an error (a cell that printed a
    # traceback and carried on, or a notebook saved half-run).
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code" and c.source.strip()]
    assert code and all(c.execution_count for c in code), f"{path.name}: saved without outputs"
    for cell in committed.cells + nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", (path.name, cell.source[:80])


def main(argv: list[str]) -> int:
    """Executes each named notebook in a temporary directory and writes it back with its
    outputs."""
    if not argv:
        print(__doc__.split("\n\n")[-1].strip())
        return 2
    for name in argv:
        path = pathlib.Path(name).resolve()
        with tempfile.TemporaryDirectory() as tmp:
            nb, seconds = execute(path, pathlib.Path(tmp))
        nbformat.write(nb, path)
        print(f"{path.name}: executed in {seconds:.1f} s, outputs written")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
