#!/usr/bin/env bash
# One lent-GPU session's measurements (the device tool runs it in the repository root; $OUT comes back):
#   1. kernels: every distinct op of the traces in .gpu/traces (the H100/H800 validate suites' and the
#      README search's trace cache) timed on this GPU -> $OUT/H100.json (echo-plan calibrate kernels --traces)
#   2. the memory headroom's parts: CUDA context and allocator fragmentation (benchmarks/cuda_memory_probe.py)
#   3. interference of compute beside a communication stand-in on another stream (calibrate interference measure)
#   4. the PyTorch-native suites' ops (torchtitan's context-parallel ring steps at 32K-256K keys, OLMo-core's, fms-fsdp's)
#      in .gpu/traces-pytorch, attention on SDPA's flash backend (FlashAttention-2, what those runs used on Hopper)
#      -> $OUT/H100-sdpa-flash.json; compare: benchmarks/kernel_accuracy.py --db that --traces .gpu/traces-pytorch
#      --cluster dgx-h100 --attention-library flash-attn-2 --kernels pytorch (issue 34's context-parallel rows)
# Python packages the GPU image lacks travel as wheels in .whl/ (pydantic, typer and their needs).
# Prepared on the machine that sends the job (both folders are ignored by git; the device tool carries them):
#   for s in nemo_h100_dgxc moe_h100 long_context_h100 megatron_bridge_h100; do
#     ECHO_PLAN_CACHE_DIR=.gpu/traces .venv/bin/echo-plan validate --suite $s --json > /dev/null; done
#   ECHO_PLAN_CACHE_DIR=.gpu/traces .venv/bin/echo-plan search --report /tmp/q.html
#   for s in fsdp_torchtitan_h100 olmo_core_h100 fms_fsdp_h100; do
#     ECHO_PLAN_CACHE_DIR=.gpu/traces-pytorch .venv/bin/echo-plan validate --suite $s --json > /dev/null; done
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection typing-extensions typer click shellingham \
#     rich markdown-it-py mdurl pygments platformdirs        (the versions .venv has)
set -u
if [ ! -d .gpu/traces ] || [ -z "$(ls .gpu/traces 2>/dev/null)" ]; then
  echo "device_measure.sh: .gpu/traces is empty; make it first (see this script's header)" >&2; exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
ep() { python3 -c "import sys; from echo_plan.cli import entry; sys.argv[0] = 'echo-plan'; entry()" "$@"; }
date -u +%FT%TZ
timeout 300 bash -c "$(declare -f ep); ep calibrate kernels --traces .gpu/traces --warmup 5 --iters 20 -o '$OUT/H100.json' --json" > "$OUT/kernels_summary.json"
echo "kernels rc=$?"; head -c 600 "$OUT/kernels_summary.json"; echo
date -u +%FT%TZ
timeout 150 python3 benchmarks/cuda_memory_probe.py --json "$OUT/memory_probe.json"
echo "memory probe rc=$?"
timeout 60 bash -c "$(declare -f ep); ep calibrate interference measure --mode standin -o '$OUT/interference_standin.csv'"
echo "interference rc=$?"
date -u +%FT%TZ
if [ -d .gpu/traces-pytorch ] && [ -n "$(ls .gpu/traces-pytorch 2>/dev/null)" ]; then
  timeout 240 bash -c "$(declare -f ep); ep calibrate kernels --traces .gpu/traces-pytorch --sdpa-backend flash --warmup 5 --iters 20 -o '$OUT/H100-sdpa-flash.json' --json" > "$OUT/kernels_sdpa_flash_summary.json"
  echo "kernels (SDPA flash) rc=$?"; head -c 400 "$OUT/kernels_sdpa_flash_summary.json"; echo
else
  echo "no .gpu/traces-pytorch: step 4 left out (see this script's header)"
fi
date -u +%FT%TZ
