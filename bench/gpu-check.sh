#!/usr/bin/env bash
# The one prepared GPU check (bench/gpu_check.py says what it measures). On a lent GPU machine, from the
# repository root:
#     bash bench/gpu-check.sh > bench/results/gpu-check.json
# About 6 minutes on one H100 or H200 once the machine is up (bench/gpu_check.py estimates each step); its checkpoint
# step writes the seed's full state, 20.5 GB, under --work DIR (default: the temporary folder), on a disk, not tmpfs.
# Here, on a CPU, the same steps on a small model of the same family:
#     bash bench/gpu-check.sh --dry-run
# It uses the image's own torch (a CUDA build on a GPU machine) and downloads nothing. On a GPU machine every wheel
# in bench/wheels/ (carried with the working tree, filled beforehand by `pip download -d bench/wheels` with the
# project's pins, e.g. transformers and msgspec) is installed into a folder of its own ahead of the image's
# packages; the project's other packages must be the image's. The dry run uses the project's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
    python="$PYTHON"
elif [[ " $* " == *" --dry-run "* && -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python=python3
fi

if [[ " $* " != *" --dry-run "* ]]; then
    # A CUDA torch, or nothing to check.
    "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || {
        echo "gpu-check: $python's torch sees no CUDA device; on a CPU use --dry-run" >&2
        exit 2
    }
    if compgen -G "bench/wheels/*.whl" >/dev/null; then
        site=$(mktemp -d)
        echo "{\"event\": \"gpu-check-install\", \"from\": \"bench/wheels\", \"into\": \"$site\"}" >&2
        "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" bench/wheels/*.whl
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

missing=()
for module in transformers safetensors tokenizers numpy scipy msgspec psutil rich; do
    "$python" -c "import $module" 2>/dev/null || missing+=("$module")
done
if ((${#missing[@]})); then
    echo "gpu-check: $python lacks ${missing[*]}; put their wheels in bench/wheels/" >&2
    exit 2
fi

exec "$python" bench/gpu_check.py "$@"
