#!/usr/bin/env bash
# The one GPU check, at most 8 minutes on an H200 by construction: every part runs under its own `timeout`, and
# the limits add up to 472 s, the grace of each `timeout -k` included (8 s left for the shell itself).
# Each part's output is written as it comes (tee), bench_kernels.py appends each CSV row as it is measured and
# gpu_loop.py rewrites its JSON after each run, so a part stopped at its limit keeps what it measured.
#
#   part                                              limit + kill   expected on an H200
#   install the wheels in .whl/ (pip, no network)       20 s + 5 s   ~5 s
#   GPU and library versions (nvidia-smi; metadata) 8+2 s; 5+2 s   ~2 s
#   kernel_tests: tests/kernels natively (pytest -n 8)  85 s + 5 s   ~30-60 s, mostly Triton compiling
#   bench_kernels.py --max-seconds 55                   95 s + 5 s   starts nothing after 55 s; 40 s for the
#                                                                    provider in flight (a 64K-token float64 truth,
#                                                                    a torch.compile)
#   packed_attention_check.py (16K tokens, 1.5B)        60 s + 5 s   ~30-40 s: model init on the CPU, ~20 forwards
#   train_throughput.py --steps 5 (16K tokens, 1.5B)    60 s + 5 s   ~30-40 s: model init on the CPU, 6 steps of
#                                                                    the update's own path (linear_policy_loss)
#   gpu_loop.py: fasttnt train, 10 steps x 2 runs     105 s + 5 s   never run: the embedded default (a 60-step
#     (hf engine, bf16) and DeepSpeed's autocast                     warm-up on the CPU first, seconds) and a
#                                                                    151,936-token stand-in, then 2 DeepSpeed
#                                                                    engines on 1 GPU
#
# Run it on a machine with a CUDA GPU, from a checkout of this repository, with torch, triton and transformers
# installed (the project need not be pip-installed: it runs from the checkout). TRL and Liger-Kernel are the
# baselines of bench_kernels.py, DeepSpeed the last part's subject; where they are not installed, put their wheels in
# .whl/ (for an offline machine: trl with datasets, dill and multiprocess, which TRL imports, and liger-kernel;
# `pip download --no-deps` them on a machine with network access) and the script installs them into /tmp/site first.
#   bash benchmarks/gpu_check.sh [out folder]        # default: benchmarks/gpu_results/<date>/
#   bash benchmarks/gpu_check.sh --smoke [out]       # a rehearsal on the CPU: every part at its --smoke shapes, the
#                                                    # kernel tests of the dispatch, under the same limits
# Each part ends as OK, SKIPPED in part (it printed `SKIPPED...` lines: a baseline, a test or DeepSpeed that
# could not run, with the reason) or FAILED (its exit status, or its time limit). summary.txt holds the machine, one
# line per part and the verdict; the check exits 1 if any part FAILED. The out folder holds 8 small files (a few
# hundred KB): summary.txt, each part's output (<part>.txt), results.csv and gpu_loop.json.
set -uo pipefail
smoke=0
if [ "${1:-}" = "--smoke" ]; then
  smoke=1
  shift
fi
out=${1:+$(realpath -m "$1")}  # a folder given relative to the caller, before the cd below
cd "$(dirname "$0")/.."
out=${out:-benchmarks/gpu_results/$(date +%Y-%m-%d)$([ $smoke = 1 ] && echo -smoke)}
mkdir -p "$out"
rm -f "$out"/*.txt "$out/results.csv" "$out/gpu_loop.json"  # a rerun into the same folder starts clean
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# the kernel tests draw fresh inputs per run; one seed for every pytest-xdist worker, printed, so a run replays
export FASTTNT_TEST_SEED=${FASTTNT_TEST_SEED:-$RANDOM}
summary=$out/summary.txt
{
  date -u
  echo "FASTTNT_TEST_SEED=$FASTTNT_TEST_SEED$([ $smoke = 1 ] && echo ' (--smoke: a rehearsal on the CPU)')"
  if compgen -G ".whl/*.whl" > /dev/null; then
    timeout -k 5 20 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && echo "installed from .whl/: $(cd .whl && echo *.whl)"
  fi
} > "$summary" 2>&1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# the project itself, uninstalled: fasttnt from the root, fasttnt_kernels from kernels/
export PYTHONPATH=$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
{
  [ $smoke = 0 ] && timeout -k 2 8 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  timeout -k 2 5 "$py" -c "import importlib.metadata as m, sys
for d in sys.argv[1:]:
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, 'not installed')" torch triton transformers accelerate trl datasets pyarrow liger-kernel flash-attn \
    deepspeed pydantic
} >> "$summary" 2>&1
cat "$summary"
echo >> "$summary"

failed=()
skipped=()
# part NAME LIMIT COMMAND...: COMMAND under `timeout`, its output to NAME.txt as it comes, its verdict to summary.txt
part() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit} s): $* =="
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]} verdict
  # pytest -rs prints `SKIPPED [n] file:line: reason`; the scripts print `SKIPPED: reason` for what they skip
  local skips
  skips=$(grep -E '^SKIPPED' "$out/$name.txt" | cut -c1-160 | head -5 | paste -sd';' -)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    verdict="FAILED (stopped at its ${limit} s limit)"
  elif [ "$rc" != 0 ]; then
    verdict="FAILED (exit $rc)"
  elif [ -n "$skips" ]; then
    verdict="SKIPPED in part: $skips"
  else
    verdict=OK
  fi
  case $verdict in
    FAILED*) failed+=("$name") ;;
    SKIPPED*) skipped+=("$name") ;;
  esac
  echo "$name: $verdict ($((SECONDS - start)) s)" | tee -a "$summary"
}

# 8 workers where pytest-xdist is installed (the H200 image has it), one process otherwise
xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n 8")
if [ $smoke = 1 ]; then
  # the interpreter runs the kernels on the CPU (tests/conftest.py): the dispatch and one kernel's file fit the limit
  part kernel_tests 85 "$py" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_dispatch.py \
    tests/kernels/test_group_advantages.py
  part bench_kernels 95 "$py" benchmarks/bench_kernels.py --smoke --max-seconds 55 --csv "$out/results.csv"
  part packed_attention 60 "$py" benchmarks/packed_attention_check.py --smoke
  part train_throughput 60 "$py" benchmarks/train_throughput.py --smoke
  part gpu_loop 105 "$py" benchmarks/gpu_loop.py --smoke --out "$out"
else
  part kernel_tests 85 "$py" -m pytest -q -rs -p no:cacheprovider $xdist tests/kernels
  part bench_kernels 95 "$py" benchmarks/bench_kernels.py --tokens 16384 65536 --hidden 1536 3584 --max-seconds 55 \
    --csv "$out/results.csv"
  part packed_attention 60 "$py" benchmarks/packed_attention_check.py
  part train_throughput 60 "$py" benchmarks/train_throughput.py --steps 5
  part gpu_loop 105 "$py" benchmarks/gpu_loop.py --steps 10 --out "$out"
fi

{
  echo
  if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}${skipped:+; skipped in part: ${skipped[*]}}"
  elif [ ${#skipped[@]} -gt 0 ]; then
    echo "no part failed; SKIPPED in part: ${skipped[*]} (see their lines above: not checked, not OK)"
  else
    echo "OK: every part ran and passed"
  fi
  echo "results in $out"
} | tee -a "$summary"
[ ${#failed[@]} -eq 0 ]
