"""The import layering of docs/architecture.md "Layers": import-linter checks the contracts in pyproject.toml
([tool.importlinter]: the layers top to bottom, no cycles inside jaxinfer, kernels_pallas free of jaxinfer)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# `lint-imports --no-cache` without relying on PATH: the linter of this interpreter, on the tree at ROOT.
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def test_import_contracts_are_kept():
    run = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if run.returncode:
        pytest.fail(f"lint-imports: an import breaks a contract of pyproject.toml\n{run.stdout}{run.stderr}",
                    pytrace=False)
