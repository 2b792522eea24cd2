#!/usr/bin/env bash
# The one GPU check: kernel tests compiled for the GPU (no interpreter), kernel benchmarks at the shapes that
# matter, packed attention against per-sequence forwards, and the training-step throughput of a Qwen2-1.5B-shaped
# policy. About 6-8 minutes on an H200.
# Everything lands in one folder: benchmarks/gpu_results/<date>/ (or the folder given as $1).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/gpu_results/$(date +%Y-%m-%d)}
mkdir -p "$out"
status=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$out/machine.txt" 2>&1
echo "== kernel tests (native) =="
timeout 300 python -m pytest -q tests/kernels 2>&1 | tee "$out/kernel_tests.txt" || status=1
echo "== kernel benchmarks =="
timeout 300 python benchmarks/bench_kernels.py --csv "$out/results.csv" 2>&1 | tee "$out/bench_kernels.txt" || status=1
echo "== packed attention: one packed row vs per-sequence forwards (Qwen2-1.5B shape, bf16, 16K tokens) =="
timeout 120 python benchmarks/packed_attention_check.py 2>&1 | tee "$out/packed_attention.txt" || status=1
echo "== training-step throughput =="
timeout 240 python benchmarks/train_throughput.py 2>&1 | tee "$out/train_throughput.txt" || status=1
echo "results in $out"
exit $status
