#!/usr/bin/env bash
# The kernel tests on jax 0.11.2, the GPU machine's release, on this CPU machine (no GPU needed).
#
# Why: from jax 0.11.2 on, GPU interpret mode runs the kernels' native code path itself (the FP8 GEMMs' wgmma on a
# K-major B, MLA's QK^T wgmma, plgpu.load into WGMMA layouts, the cluster barriers of TMA multicast), where CI's
# jax 0.10.2 needs value-level stand-ins for them (kernels_pallas/_mosaic.py ``substitute_wgmma``). So the same
# interpret-mode tests, run here, check the instructions a GPU runs; cross-lowering and the ptxas report's tests
# run on 0.11.2 as well. jax 0.11 needs Python >= 3.12, so this builds its own venv (VENV, default .venv-jax011) with
# PYTHON (default python3.12, else pyenv's 3.12), kernel dependencies only: the kernels need nothing of jaxinfer's.
# Usage: bash scripts/kernel_tests_jax011.sh [pytest args...]   (default: tests/kernels, 2 workers)
#        bash scripts/kernel_tests_jax011.sh --all [pytest args...]: also installs jaxinfer itself (editable, with
#        its runtime dependencies and the notebook runner) and runs the whole suite as CI does, except the modules
#        that need torch: the torch==2.13.0 wheel on this machine is for Python 3.11 only (PyPI's torch for 3.12 is
#        a CUDA build of several GB), so those modules fail to import and are reported as collection errors.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.12}
if ! "$PYTHON" -c "" 2>/dev/null; then   # pyenv machines: a 3.12 that is installed but not on the global path
  PYTHON=$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.12*/bin/python 2>/dev/null | tail -n 1)
  [ -n "$PYTHON" ] || { echo "no Python 3.12 found: set PYTHON=/path/to/python3.12" >&2; exit 2; }
fi
VENV=${VENV:-.venv-jax011}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
all=0
extra=()
if [ "${1:-}" = "--all" ]; then
  all=1
  shift
  extra=(-e . nbclient nbformat ipykernel)
fi
"$VENV/bin/pip" install -q "jax==0.11.2" "jaxlib==0.11.2" numpy ml_dtypes hypothesis pytest pytest-xdist \
  pytest-timeout "${extra[@]}"
"$VENV/bin/python" -c "import jax; assert jax.__version_info__ == (0, 11, 2), jax.__version__"
# A compilation cache of its own: entries written by another jax release are not this one's.
export JAXINFER_TEST_CACHE=${JAXINFER_TEST_CACHE:-$PWD/.jax_cache_jax011}
if [ "$all" -eq 1 ]; then
  set -- -q -n 2 --dist loadfile --continue-on-collection-errors "$@"
elif [ "$#" -eq 0 ]; then
  set -- -q -n 2 tests/kernels
fi
PYTHONPATH=. exec "$VENV/bin/python" -m pytest "$@"
