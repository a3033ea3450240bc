#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) as one command of at most 8 minutes: the wheels that
# benchmarks/gpu_wheels.sh put in .gpu-wheels/ installed offline, then the five parts, each part's JSON under $OUT
# and all the output in $OUT/gpu_check.log (docs/gpu.md).
#
#     bash benchmarks/gpu_check.sh             # on the GPU machine, with .gpu-wheels beside the repository's files
#     bash benchmarks/gpu_check.sh --dry-run   # the same parts on the CPU, on a small model, under $OUT/dry_run/
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}  # on the GPU machine the python3 that holds CUDA torch
export OUT=${OUT:-output/gpu_check} PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tiny_grpo/, the experiments' plumbing, where nothing installed it
if ! command -v "$PYTHON" >/dev/null; then
    echo "error: no python at PYTHON=$PYTHON; set PYTHON to the python that holds torch" >&2
    exit 1
fi
if [[ " $* " == *" --dry-run "* ]]; then
    :  # the packages of the environment it runs in
elif [[ ! -d .gpu-wheels ]]; then
    echo "no .gpu-wheels here (benchmarks/gpu_wheels.sh makes it): the machine's own packages"
elif "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    # (where CUDA is not, or torch: the wheels, made for the GPU machine's python, are left alone and the refusal
    # below says what is missing, not pip that a wheel does not fit this python)
    site=/tmp/gpu-check-site  # the carried packages, ahead of the image's own on the path
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        --find-links .gpu-wheels .gpu-wheels/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(ls .gpu-wheels/*.whl | wc -l) wheels from .gpu-wheels in $SECONDS s"
fi
if [[ " $* " == *" -h "* || " $* " == *" --help "* ]]; then
    exec "$PYTHON" benchmarks/gpu_check.py --help
fi
# First the refusal (a package missing, no CUDA) or the folder it writes in ($OUT, or $OUT/dry_run): nothing is made
# or emptied before it, so that a GPU run's JSON and log there stay as they were
out=$("$PYTHON" benchmarks/gpu_check.py --ready "$@") || exit
mkdir -p "$out"
# tee -i: a Ctrl-C stops the check, whose last lines (the part stopped) still reach the log
"$PYTHON" benchmarks/gpu_check.py --out "$out" --seconds $((480 - SECONDS)) "$@" 2>&1 | tee -i "$out/gpu_check.log"
