#!/usr/bin/env bash
# The one prepared GPU check (bench/gpu_check.py says what it measures). On a lent GPU machine, from the
# repository root:
#     bash bench/gpu-check.sh > bench/results/gpu-check.json
# Here, on a CPU, the same steps on a small model of the same family:
#     bash bench/gpu-check.sh --dry-run
# It uses the image's own torch (a CUDA build on a GPU machine) and downloads nothing. The project's other
# packages are imported from the interpreter; any that are missing are installed from bench/wheels/ (carried
# with the working tree, filled beforehand by `pip download -d bench/wheels <package>...`), never from an index.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
    python="$PYTHON"
elif [[ " $* " == *" --dry-run "* && -x .venv/bin/python ]]; then
    python=.venv/bin/python
else
    python=python3
fi

needed=(transformers safetensors tokenizers numpy msgspec psutil rich)
missing=()
for module in "${needed[@]}"; do
    "$python" -c "import $module" 2>/dev/null || missing+=("$module")
done
if ((${#missing[@]})); then
    if [[ ! -d bench/wheels ]]; then
        echo "gpu-check: $python lacks ${missing[*]}, and there is no bench/wheels/ to install them from" >&2
        exit 2
    fi
    echo "{\"event\": \"gpu-check-install\", \"from\": \"bench/wheels\", \"packages\": \"${missing[*]}\"}" >&2
    "$python" -m pip install --quiet --no-index --find-links bench/wheels "${missing[@]}"
fi

if [[ " $* " != *" --dry-run "* ]]; then
    # A CUDA torch, or nothing to check.
    "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || {
        echo "gpu-check: $python's torch sees no CUDA device; on a CPU use --dry-run" >&2
        exit 2
    }
fi

exec "$python" bench/gpu_check.py "$@"
