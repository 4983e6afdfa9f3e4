#!/bin/bash
# Runs benchmarks.gpu_check on a lent GPU machine (the `device` tool), whose Python has torch
# but not OR-Tools or HiGHS and no network. Once, on the developer machine, in the repo root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       ortools==9.15.6755 highspy==1.16.0 immutabledict protobuf==6.33.6
#
# then run `bash benchmarks/gpu_run.sh --parts device,nccl,...` there with `.whl` carried.
# The wheels and autopar go into /tmp/site, and gpu_check runs from /tmp so that the installed
# autopar (its package-dir layout mapped) is the one imported. Output lands in $OUT.
set -e
REPO=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1
cd /tmp
python3 -c "import torch, autopar, ortools, highspy; print(torch.__version__, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
python3 -m benchmarks.gpu_check --out "${OUT:-gpu_check}" "$@" 2>&1 | tee "${OUT:-.}/log.txt"
