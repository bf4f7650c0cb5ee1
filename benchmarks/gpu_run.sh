#!/usr/bin/env bash
# The GPU issue's one command: checks and measurements on one GPU, < 8 minutes, no internet.
#
#   OUT=/some/dir bash benchmarks/gpu_run.sh              # on the GPU machine (python3 with torch/triton)
#   OUT=/tmp/dry  bash benchmarks/gpu_run.sh --cpu-dry-run  # the same steps on the CPU, tiny sizes
#
# Writes into $OUT: gpu_results.json, gpu_log.txt, pytest_gpu.txt, batching_curve.png, throughput.png,
# block_step.json, kernel_bench_tinyllama_heads.json (at most 8 files). Each step runs in its own process
# under `timeout`, so a crash or a hang costs only that step. The package is made importable without
# installing anything: PYTHONPATH points at the repository, and a tiny sitecustomize maps
# `lifeofprompt.kernels` to kernels/ (what pyproject's package-dir does for an installed copy).
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/lifeofprompt_gpu_out}"
if [ -z "${WORK:-}" ]; then   # a scratch folder of our own: removed when the script ends, however it ends
  WORK="$(mktemp -d /tmp/lifeofprompt_gpu_work.XXXXXX)"
  trap 'rm -rf "$WORK"' EXIT
fi
PY="${PYTHON:-python3}"
DRY=""
if [ "${1:-}" = "--cpu-dry-run" ]; then DRY="--cpu-dry-run"; fi
mkdir -p "$OUT" "$WORK/site"
LOG="$OUT/gpu_log.txt"
: > "$LOG"
START=$(date +%s)

cat > "$WORK/site/sitecustomize.py" <<EOF
# Written by benchmarks/gpu_run.sh: import lifeofprompt.kernels from $REPO/kernels without installing.
import importlib.abc, importlib.util, sys
class _KernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lifeofprompt.kernels":
            return importlib.util.spec_from_file_location(
                name, "$REPO/kernels/__init__.py", submodule_search_locations=["$REPO/kernels"])
        return None
sys.meta_path.insert(0, _KernelsFinder())
EOF
export PYTHONPATH="$REPO:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export WORK OUT
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
[ -n "$DRY" ] && export CUDA_VISIBLE_DEVICES=""

say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

TOTAL_BUDGET="${TOTAL_BUDGET:-455}"   # seconds for all steps but the summary: the whole stays < 8 min
run_step() {  # run_step NAME SECONDS COMMAND...  (the budget shrinks to what is left of TOTAL_BUDGET)
  local name="$1" budget="$2"; shift 2
  local left=$(( TOTAL_BUDGET - ($(date +%s) - START) ))
  if [ "$name" != summary ] && [ $left -lt $budget ]; then budget=$left; fi
  if [ $budget -lt 10 ]; then say "== $name SKIPPED (out of time)"; return; fi
  case ",${SKIP_STEPS:-}," in *",$name,"*) say "== $name SKIPPED (SKIP_STEPS)"; return;; esac
  say "== $name (budget ${budget}s)"
  timeout -k 10 "$budget" "$@" >> "$LOG" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then say "== $name ok"; else say "== $name FAILED rc=$rc$( [ $rc -ge 124 ] && echo ' (timeout)')"; fi
}

say "repo $REPO; out $OUT; work $WORK; python $($PY --version 2>&1)"
if ! $PY -c "import lifeofprompt, lifeofprompt.kernels, lifeofprompt.engine.model_runner" >> "$LOG" 2>&1; then
  say "import via PYTHONPATH failed; trying an offline editable install"
  $PY -m pip install --no-deps --no-build-isolation --no-index -e . >> "$LOG" 2>&1 || say "pip install failed too"
fi

CHECK="$PY benchmarks/gpu_check.py"
run_step env     20  $CHECK env $DRY
run_step machine 30  $CHECK machine $DRY
if [ -n "$DRY" ]; then
  run_step pytest 120 $PY -m pytest tests/gpu -q -p no:cacheprovider --timeout=60 -rs
else
  run_step pytest "${PYTEST_BUDGET:-200}" $PY -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider --timeout=100 --maxfail=8 -rfEs --durations=8
fi
# keep the pytest section on its own too
awk '/== pytest \(budget/{on=1} on{print} /== pytest (ok|FAILED)/{on=0}' "$LOG" > "$WORK/pytest.txt"
cp "$WORK/pytest.txt" "$OUT/pytest_gpu.txt"
run_step kernel  40  $CHECK kernel $DRY
if [ -f benchmarks/kernel_bench.py ] && [ -z "$DRY" ] && [[ ",${SKIP_STEPS:-}," != *",kbench,"* ]]; then
  say "== python benchmarks/kernel_bench.py (budget 25s)"
  timeout -k 5 25 $PY benchmarks/kernel_bench.py --out "$OUT/kernel_bench_tinyllama_heads.json" > "$WORK/kernels_bench.txt" 2>&1; say "benchmarks/kernel_bench.py rc=$?"
  tail -n 30 "$WORK/kernels_bench.txt" >> "$LOG"
fi
run_step decode  90  $CHECK decode $DRY
run_step block   60  $PY benchmarks/gpu_block_step.py $DRY   # GGUF block weights: batch-1 products and forward vs floor -> $OUT/block_step.json
run_step ours    75  $CHECK ours $DRY --ours-deadline 40
if [ -n "$DRY" ]; then PEER_CAP=30; else PEER_CAP=50; fi
run_step peer    70  $CHECK peer $DRY --peer-timeout $PEER_CAP
run_step story   30  $CHECK story $DRY
run_step overlap 45  $CHECK overlap $DRY   # async scheduling on/off (eager) and CUDA graphs, in turns
run_step collectives 40 $CHECK collectives $DRY   # the process group of one rank against one process
run_step summary 20  $CHECK summary $DRY
say "total $(( $(date +%s) - START ))s; files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
# The summary table last, where a reader looks first.
sed -n '/^=\{100\}$/,/^=\{100\}$/p' "$LOG" | tail -n 40
