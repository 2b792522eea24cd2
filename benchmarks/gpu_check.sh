#!/usr/bin/env bash
# The one GPU check, at most 8 minutes on an H200 by construction: every part runs under its own `timeout`, and
# the limits add up to 472 s, the grace of each `timeout -k` included (8 s left for the shell itself).
# Each part's output is written as it comes (tee), and bench_kernels.py appends each CSV row as it is measured,
# so a part stopped at its limit keeps what it measured.
#
#   part                                              limit + kill   expected on an H200
#   install the wheels in .whl/ (pip, no network)       20 s + 5 s   ~5 s
#   GPU and library versions (nvidia-smi; metadata) 8+2 s; 5+2 s   ~2 s
#   kernel tests, natively (pytest -n 8)                85 s + 5 s   ~30-60 s, mostly Triton compiling
#   bench_kernels.py --max-seconds 55                   95 s + 5 s   starts nothing after 55 s; 40 s for the
#                                                                    provider in flight (a 64K-token float64 truth,
#                                                                    a torch.compile)
#   packed_attention_check.py (16K tokens, 1.5B)        60 s + 5 s   ~30-40 s: model init on the CPU, ~20 forwards
#   train_throughput.py --steps 5 (16K tokens, 1.5B)    60 s + 5 s   ~30-40 s: model init on the CPU, 6 steps
#   gpu_loop.py: fasttnt train, 10 steps x 2 runs     105 s + 5 s   never run: the embedded default (an 800-step
#     (hf engine, bf16) and DeepSpeed's autocast                     warm-up first) and a 151,936-token stand-in,
#                                                                    then 2 DeepSpeed engines on 1 GPU
#
# Run it on a machine with a CUDA GPU, from a checkout of this repository, with torch, triton and transformers
# installed (the project need not be pip-installed: it runs from the checkout). TRL and Liger-Kernel are the
# baselines of bench_kernels.py; where they are not installed, put their wheels in .whl/ (for an offline machine:
# trl with datasets, dill and multiprocess, which TRL imports, and liger-kernel; `pip download --no-deps` them on a
# machine with network access) and the script installs them into /tmp/site first. Then:
#   bash benchmarks/gpu_check.sh [out folder]        # default: benchmarks/gpu_results/<date>/
# It exits 1 if any part failed; the out folder holds machine.txt, each part's output and results.csv.
set -uo pipefail
out=${1:+$(realpath -m "$1")}  # a folder given relative to the caller, before the cd below
cd "$(dirname "$0")/.."
out=${out:-benchmarks/gpu_results/$(date +%Y-%m-%d)}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# the kernel tests draw fresh inputs per run; one seed for every pytest-xdist worker, printed, so a run replays
export FASTTNT_TEST_SEED=${FASTTNT_TEST_SEED:-$RANDOM}
status=0
{
  date -u
  echo "FASTTNT_TEST_SEED=$FASTTNT_TEST_SEED"
  if compgen -G ".whl/*.whl" > /dev/null; then
    timeout -k 5 20 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && echo "installed from .whl/: $(cd .whl && echo *.whl)"
  fi
} > "$out/machine.txt" 2>&1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# the project itself, uninstalled: fasttnt from the root, fasttnt_kernels from kernels/
export PYTHONPATH=$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
{
  timeout -k 2 8 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  timeout -k 2 5 "$py" -c "import importlib.metadata as m, sys
for d in sys.argv[1:]:
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, 'not installed')" torch triton transformers accelerate trl datasets pyarrow liger-kernel
} >> "$out/machine.txt" 2>&1
cat "$out/machine.txt"
echo "== kernel tests (native) =="
# 8 workers where pytest-xdist is installed (the H200 image has it), one process otherwise
xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n 8")
timeout -k 5 85 "$py" -m pytest -q $xdist tests/kernels 2>&1 | tee "$out/kernel_tests.txt" || status=1
echo "== kernel benchmarks: N = 16K then 64K tokens, the 1.5B and 7B widths, Qwen2 vocabulary, bf16 =="
timeout -k 5 95 "$py" benchmarks/bench_kernels.py --tokens 16384 65536 --hidden 1536 3584 --max-seconds 55 \
  --csv "$out/results.csv" 2>&1 | tee "$out/bench_kernels.txt" || status=1
echo "== packed attention: one packed row vs per-sequence forwards (Qwen2-1.5B shape, bf16, 16K tokens) =="
timeout -k 5 60 "$py" benchmarks/packed_attention_check.py 2>&1 | tee "$out/packed_attention.txt" || status=1
echo "== training-step throughput (Qwen2-1.5B shape, 16K-token packed micro-batches) =="
timeout -k 5 60 "$py" benchmarks/train_throughput.py --steps 5 2>&1 | tee "$out/train_throughput.txt" || status=1
echo "== the loop: fasttnt train on CUDA (hf engine, bf16 autocast), 10 steps x 2 runs; DeepSpeed's autocast =="
# DeepSpeed from .whl/ where the image lacks it (with hjson, ninja, py-cpuinfo, msgpack, which it imports)
timeout -k 5 105 "$py" benchmarks/gpu_loop.py --steps 10 --out "$out/loop" 2>&1 | tee "$out/gpu_loop.txt" || status=1
echo "results in $out (exit $status)"
exit $status
