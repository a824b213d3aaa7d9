#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA device and a CUDA build of torch (CI has
# none): the tests marked `gpu` (tests/test_gpu.py), then a short `rlnb train` of a
# Hugging Face model on the GPU in bfloat16. Logs go to $OUT (default /tmp/rlnb-gpu).
#
# It uses the machine's own python3 and packages (PYTHON=... for another); rlnb runs
# from this checkout. Packages that machine lacks (torchdata, say) can come as wheels
# in .whl/, fetched on a machine with a package index, e.g. for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl torchdata==0.11.0
# vLLM's GPU test runs only where vLLM's CUDA build is installed (and is skipped
# outside a loopback-only network namespace, as every test that listens is).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/rlnb-gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rlnb-site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/rlnb-site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt" || true
"$py" - << 'EOF' 2>&1 | tee -a "$out/gpu.txt"
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
EOF
status=0
"$py" -m pytest -m gpu -p no:randomly -ra --durations=10 tests/test_gpu.py 2>&1 | tee "$out/pytest.log" || status=1
model=$(mktemp -d /tmp/rlnb-gpu-model.XXXXXX)
"$py" -m rlnb make-tiny-llama "$model/m" > /dev/null
"$py" -m rlnb train --model "$model/m" --device cuda --dtype bfloat16 --steps 30 --warmup-steps 20 \
    --run-dir "$out/run" --no-progress --json > "$out/train.json" 2> "$out/train.log" || status=1
cat "$out/train.log" "$out/train.json"
rm -rf "$model"
exit "$status"
