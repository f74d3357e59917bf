#!/usr/bin/env bash
# Fills a folder with wheels of the Python packages dipaco needs that the lent GPU machine's image lacks,
# built for that machine (CPython 3.12, x86-64, manylinux), on a machine that reaches the package index.
# The GPU machine reaches no index: scripts/gpu_check.py --wheels DIR installs these there, offline, before
# it imports dipaco.
#
#   scripts/gpu_wheels.sh gpu_carry/wheels     # datasets, omegaconf and pytest, with what they need beyond the image
#
# Not Ray: its wheel (76 MiB for ray 2.60.0, CPython 3.12) is larger than the 64 MiB a device call carries in
# all, so gpu_check records its Ray check as not run there unless the image has Ray.
#
# The image holds torch, transformers, tokenizers, safetensors, scikit-learn, scipy, numpy, pyarrow, pandas,
# fsspec, huggingface-hub, xxhash, pyyaml, requests, click, msgpack, protobuf (the device notes' package list);
# torch is never downloaded. Each wheel is fetched without its dependencies (the image's own versions stay), so
# the list below names every missing one. Versions: the ones installed where this runs (what the test suite ran
# with), else the newest.
#
# Environment: PYTHON (the interpreter whose pip downloads, default python3), GPU_PYTHON_VERSION (default 3.12),
# GPU_WHEELS_PACKAGES (replaces the list: NAME or NAME==VERSION, space-separated).
set -euo pipefail

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    echo "usage: $0 DIR"
}

if [[ $# -ne 1 || $1 == -h || $1 == --help ]]; then
    usage
    [[ $# -eq 1 ]] && exit 0 || exit 2
fi
dir=$1

py=${PYTHON:-python3}
python_version=${GPU_PYTHON_VERSION:-3.12}
# datasets 5 needs dill and multiprocess beyond the image; omegaconf 2.4 needs only pyyaml; pytest (the device
# tests of the cuda_paths section) needs iniconfig, pluggy and pygments.
packages=(datasets omegaconf dill multiprocess pytest iniconfig pluggy pygments)
if [[ -n ${GPU_WHEELS_PACKAGES:-} ]]; then
    read -r -a packages <<< "$GPU_WHEELS_PACKAGES"
fi

# NAME -> NAME==VERSION installed here, when it is.
pinned() {
    local spec=$1 version
    if [[ $spec == *"=="* ]]; then
        echo "$spec"
        return
    fi
    version=$("$py" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$spec" 2>/dev/null) || true
    if [[ -n $version ]]; then echo "$spec==$version"; else echo "$spec"; fi
}

mkdir -p "$dir"
for name in "${packages[@]}"; do
    spec=$(pinned "$name")
    echo "== $spec (CPython $python_version, manylinux x86-64)"
    # pip matches each manylinux tag exactly: the ones the device notes list, newest first.
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --dest "$dir" "$spec"
done

# Two versions of one package stop the whole offline install: refuse them here.
dupes=$(for f in "$dir"/*.whl; do basename "$f" | cut -d- -f1 | tr '[:upper:]-' '[:lower:]_'; done | sort | uniq -d)
if [[ -n $dupes ]]; then
    echo "error: $dir holds more than one version of: $dupes (keep one)" >&2
    exit 1
fi
size_kib=$(du -sk "$dir" | cut -f1)
echo "$dir: $(ls "$dir"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB"
if (( size_kib > 48 * 1024 )); then
    echo "warning: over 48 MiB of wheels: with the repository and the data, a device call may exceed the 64 MiB it carries" >&2
fi
