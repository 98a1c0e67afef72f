"""Executes notebooks headless for tests/it/notebooks.rs, in a kernel that runs
this very Python (the notebooks venv's, built by .ci/setup.d/60-notebooks.sh).

    python run.py --out DIR [--label NAME] [--timeout S] [--cwd DIR] NOTEBOOK...

Each notebook runs with its own folder as the working directory (as Jupyter
does; --cwd picks another, to check that the notebooks do not depend on it),
the environment as given (KVTRAIL_* parameters), and a per-cell timeout. The
executed copy is written to DIR/<label>-<name>.ipynb, never back next to the
source. On the first failing cell it prints the notebook, the cell's index
and source and the error's traceback, and exits 1.

The kernel: a kernelspec named python3 whose argv is this interpreter is put
in a private JUPYTER_PATH folder under DIR, which Jupyter searches first, so
no kernel of another Python (a user's or a system one) can be picked up and
nothing is registered or written outside DIR (runtime files and the
IPython profile go there as well). A last, unsaved cell checks that the
kernel's sys.executable is this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

CHECK_TAG = "kvtrail-runner-kernel-check"


def private_kernelspec(out: Path) -> None:
    kdir = out / "jupyter-path" / "kernels" / "python3"
    kdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (kvtrail notebooks venv)",
        "language": "python",
    }
    (kdir / "kernel.json").write_text(json.dumps(spec, indent=1))
    os.environ["JUPYTER_PATH"] = str(out / "jupyter-path")
    # Connection files and IPython's profile stay under DIR too, not in $HOME.
    os.environ["JUPYTER_RUNTIME_DIR"] = str(out / "jupyter-runtime")
    os.environ["IPYTHONDIR"] = str(out / "ipython")
    # Plots render to PNG outputs in the executed copies, never to a window.
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")


def fail(nb_path: Path, idx: int | None, source: str, err: str) -> None:
    err = re.sub(r"\x1b\[[0-9;]*m", "", err)  # IPython colours the traceback
    print(f"NOTEBOOK FAILED: {nb_path}", file=sys.stderr)
    if idx is not None:
        print(f"--- cell {idx} source ---", file=sys.stderr)
        print(source, file=sys.stderr)
    print("--- error ---", file=sys.stderr)
    print(err, file=sys.stderr)
    sys.exit(1)


def run_one(nb_path: Path, out: Path, label: str, timeout: int, cwd: Path | None) -> None:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(nb_path, as_version=4)
    nbformat.validate(nb)
    check = nbformat.v4.new_code_cell(
        "import sys\nprint('KERNEL-EXECUTABLE=' + sys.executable)",
        metadata={"tags": [CHECK_TAG]},
    )
    nb.cells.append(check)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd or nb_path.parent)}},
    )
    t0 = time.monotonic()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as e:
        idx, src = None, ""
        for i, c in enumerate(nb.cells):
            if c.cell_type != "code":
                continue
            for o in c.get("outputs", []):
                if o.get("output_type") == "error":
                    idx, src = i, c.source
        if idx is None and isinstance(e, CellTimeoutError):
            # The timed-out cell is the last one that started.
            for i, c in enumerate(nb.cells):
                if c.cell_type == "code" and c.get("execution_count") is not None:
                    idx, src = i, c.source
        dump = out / f"{label}-{nb_path.stem}.failed.ipynb"
        nbformat.write(nb, dump)
        fail(nb_path, idx, src, f"{e}\n(executed copy with outputs: {dump})")
    wall = time.monotonic() - t0
    text = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []))
    want = "KERNEL-EXECUTABLE=" + sys.executable
    if want not in text:
        fail(nb_path, None, "", f"the kernel did not run {sys.executable}: {text!r}")
    nb.cells.pop()
    dest = out / f"{label}-{nb_path.stem}.ipynb"
    nbformat.write(nb, dest)
    n = sum(1 for c in nb.cells if c.cell_type == "code")
    print(f"ok {label} {nb_path.name}: {n} code cells in {wall:.1f} s -> {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--label", default="run")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per cell")
    ap.add_argument("--cwd", type=Path, help="working directory of the kernel (default: the notebook's folder)")
    ap.add_argument("notebooks", nargs="+", type=Path)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    private_kernelspec(a.out)
    for nb in a.notebooks:
        run_one(nb.resolve(), a.out.resolve(), a.label, a.timeout, a.cwd.resolve() if a.cwd else None)


if __name__ == "__main__":
    main()
