#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) as one command of at most 8 minutes on a lent GPU machine: the wheels that
# benchmarks/gpu_wheels.sh put in .gpu-wheels/ installed offline, then the five parts, each part's JSON under $OUT
# and all the output in $OUT/gpu_check.log (docs/gpu.md).
#
#     bash benchmarks/gpu_check.sh             # on the GPU machine, the call carrying .gpu-wheels
#     bash benchmarks/gpu_check.sh --dry-run   # the same parts on the CPU, on a small model, in seconds
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}  # on the GPU machine the python3 that holds CUDA torch
export OUT=${OUT:-output/gpu_check} PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tiny_grpo/, the experiments' plumbing, where nothing installed it
if [[ " $* " == *" --dry-run "* ]]; then
    :  # the packages of the environment it runs in
elif [[ -d .gpu-wheels ]]; then
    site=/tmp/gpu-check-site  # the carried packages, ahead of the image's own on the path
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        --find-links .gpu-wheels .gpu-wheels/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(ls .gpu-wheels/*.whl | wc -l) wheels from .gpu-wheels in $SECONDS s"
else
    echo "no .gpu-wheels here (benchmarks/gpu_wheels.sh makes it): the machine's own packages"
fi
"$PYTHON" benchmarks/gpu_check.py --out "$OUT" --seconds $((480 - SECONDS)) "$@" 2>&1 | tee "$OUT/gpu_check.log"
