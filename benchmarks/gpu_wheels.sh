#!/usr/bin/env bash
# The Python packages the GPU machine lacks, as wheels in .gpu-wheels/ (git ignores it), for benchmarks/gpu_check.sh
# to install there offline. That machine has Python 3.12, torch 2.11 + CUDA 13, accelerate, safetensors, tokenizers
# and huggingface-hub, and no network (docs/gpu.md). Here: the pinned transformers, peft, bitsandbytes and TRL, and
# what TRL and tests/test_cuda.py need beyond the image: datasets (with dill and multiprocess, at the versions its
# pins allow) and bm25s (the multi-turn QA copy's retriever). A command carries at most 64 MiB, the repository's
# files included, so bitsandbytes keeps its CUDA 13 and CPU libraries alone (its wheel holds one for each CUDA and
# ROCm release: 43 MB).
#
#     bash benchmarks/gpu_wheels.sh
#
# The wheels are downloaded into .gpu-wheels.partial/ and take .gpu-wheels/'s place only when all of them are there:
# without network, or stopped, the .gpu-wheels/ of the last complete run stays as it was.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
NEW=$WHEELS.partial  # beside it, on the same disk: renamed at the end
PYTHON=${PYTHON:-python3}
pin() { grep -h "^$1==" requirements.txt benchmarks/requirements.txt; }  # the version the tests run against

trap 'rm -rf "$NEW"' EXIT  # a failed or stopped download leaves no half folder behind
trap 'exit 130' INT TERM HUP
rm -rf "$NEW" && mkdir -p "$NEW"
if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$NEW" \
    "$(pin transformers)" "$(pin peft)" "$(pin bitsandbytes)" "$(pin trl)" "$(pin datasets)" "$(pin bm25s)" \
    dill==0.4.1 multiprocess==0.70.19; then
    echo "error: pip download failed (no network, or no PyPI?); $WHEELS/ is kept as it was" >&2
    exit 1
fi

# bitsandbytes without the libraries of other CUDA and ROCm releases: the wheel rewritten, RECORD without them
"$PYTHON" - "$NEW"/bitsandbytes-*.whl <<'EOF'
import os, re, sys, zipfile

path = sys.argv[1]
keep = lambda name: not re.search(r"/libbitsandbytes_\w+\.so$", name) or re.search(r"_(cuda13\d|cpu)\.so$", name)
with zipfile.ZipFile(path) as old, zipfile.ZipFile(path + ".new", "w", zipfile.ZIP_DEFLATED) as new:
    left_out = [info for info in old.infolist() if not keep(info.filename)]
    for info in old.infolist():
        data = old.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(line for line in data.decode().splitlines(True) if keep(line.split(",")[0])).encode()
        if keep(info.filename):
            new.writestr(info, data)
os.replace(path + ".new", path)
mb = sum(info.file_size for info in left_out) / 1e6
print(f"left out of {os.path.basename(path)} ({mb:.0f} MB unpacked): "
      + ", ".join(sorted(os.path.basename(info.filename) for info in left_out)))
EOF

# What a call carries: the wheels and the repository's own files (tracked, and untracked ones git does not ignore)
wheels=$(du -cb "$NEW"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard -- . ":(exclude)$NEW" | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s}')
ls -1 "$NEW"
echo "wheels: $((wheels / 1048576)) MiB; with the repository's files: $(((wheels + tree) / 1048576)) MiB of the 64 a call carries"
if ((wheels + tree > 64 * 1048576)); then
    echo "error: over 64 MiB: a call would refuse it; $WHEELS/ is kept as it was" >&2
    exit 1
fi

# The complete set in .gpu-wheels/'s place: the old one set aside, the new one renamed, the old one removed
rm -rf "$WHEELS.old"
if [[ -e $WHEELS ]]; then
    mv "$WHEELS" "$WHEELS.old"
fi
mv "$NEW" "$WHEELS"
rm -rf "$WHEELS.old"
echo "in $WHEELS/"
