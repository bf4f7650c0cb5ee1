#!/usr/bin/env bash
# The numerics tests (pytest -m numerics: results that depend on floating-point kernels) once per
# forced kernel setting, so a test that holds only on this CPU's own kernels shows up here and not on
# the next machine. Outside CI: about 5 minutes a setting on 2 cores (309 tests), about 45 for all nine.
#
#   bash scripts/portability.sh                 every setting below
#   bash scripts/portability.sh default path-rowwise    only the named ones
#
# Settings (the tests' own pins are one product path, "linear", and one thread; see tests/conftest.py):
#   default              what the tests pin, this CPU's best kernels
#   aten-avx2            ATEN_CPU_CAPABILITY=avx2: torch's element-wise and reduction kernels for AVX2
#   onednn-avx2          ONEDNN_MAX_CPU_ISA=AVX2: oneDNN (and so its bf16 and packed products) without AVX-512/AMX
#   aten-onednn-avx2     both
#   c-avx2               LIFEOFPROMPT_NATIVE_MARCH=x86-64-v3: our C kernels (model/cpu_*.c) built for AVX2, so
#                        their narrower tiles run (the packed tile of 2 rows, 8 lanes) on an AVX-512 machine
#   path-<name>          LIFEOFPROMPT_CPU_TUNING=<name> for every engine, one per path lifeofprompt.model.linear.PATHS
#                        names (linear is the default's); skipped where the chooser says it is unavailable
#   threads-2            LIFEOFPROMPT_TEST_THREADS=2 (1 is the default's): BLAS splits products otherwise
# The AVX2 settings run on x86-64 only. Each setting runs under `timeout` (PORTABILITY_TIMEOUT seconds,
# default 900); logs go to $PORTABILITY_LOGS (default a new folder under /tmp). Exit status 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LIMIT=${PORTABILITY_TIMEOUT:-900}
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false

# The product paths the engine's chooser knows, and those this machine can run (empty: no chooser).
KNOWN=$("$PYTHON" -c 'from lifeofprompt.model.linear import PATHS; print(" ".join(PATHS))' 2>/dev/null)
PATHS=$("$PYTHON" -c 'from lifeofprompt.model.linear import available_paths; print(" ".join(available_paths()))' 2>/dev/null)
ALL=(default aten-avx2 onednn-avx2 aten-onednn-avx2 c-avx2)
for path in ${KNOWN:-transposed transposed_doubled onednn rowwise}; do
  [ "$path" = linear ] || ALL+=("path-$path")
done
ALL+=(threads-2)
if [ $# -gt 0 ]; then SETTINGS=("$@"); else SETTINGS=("${ALL[@]}"); fi

environment() {       # the variables of one setting, as NAME=value words
  case "$1" in
    default) ;;
    aten-avx2) echo "ATEN_CPU_CAPABILITY=avx2" ;;
    onednn-avx2) echo "ONEDNN_MAX_CPU_ISA=AVX2" ;;
    aten-onednn-avx2) echo "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" ;;
    c-avx2) echo "LIFEOFPROMPT_NATIVE_MARCH=x86-64-v3" ;;
    path-*) echo "LIFEOFPROMPT_CPU_TUNING=${1#path-}" ;;
    threads-*) echo "LIFEOFPROMPT_TEST_THREADS=${1#threads-}" ;;
    *) return 1 ;;
  esac
}

skip_reason() {       # empty when the setting can run here
  case "$1" in
    *avx2) [ "$(uname -m)" = x86_64 ] || echo "not x86-64" ;;
    path-*) if [ -z "$PATHS" ]; then echo "no product-path chooser (lifeofprompt.model.linear.available_paths)";
            elif ! [[ " $PATHS " == *" ${1#path-} "* ]]; then echo "unavailable here (available: $PATHS)"; fi ;;
  esac
}

for setting in "${SETTINGS[@]}"; do
  environment "$setting" >/dev/null || { echo "unknown setting: $setting (known: ${ALL[*]})" >&2; exit 2; }
done
LOGS=${PORTABILITY_LOGS:-$(mktemp -d /tmp/portability.XXXXXX)}
mkdir -p "$LOGS"

declare -a ROWS
failed=0
for setting in "${SETTINGS[@]}"; do
  vars=$(environment "$setting")
  reason=$(skip_reason "$setting")
  if [ -n "$reason" ]; then
    ROWS+=("$(printf '%-24s %-8s %8s  %s' "$setting" skipped - "$reason")")
    continue
  fi
  log="$LOGS/$setting.log"
  echo "== $setting ${vars:+($vars)} -> $log"
  start=$(date +%s)
  # shellcheck disable=SC2086  # $vars is a list of NAME=value words
  env $vars timeout "$LIMIT" "$PYTHON" -c 'import torch; print("torch CPU capability:", torch.backends.cpu.get_cpu_capability())' >"$log" 2>&1
  env $vars timeout "$LIMIT" "$PYTHON" -m pytest tests -m "numerics and not browser and not gpu" \
    -p no:cacheprovider -q -rfE >>"$log" 2>&1
  status=$?
  seconds=$(( $(date +%s) - start ))
  capability=$(sed -n 's/^torch CPU capability: //p' "$log" | head -1)
  summary=$(grep -E '^=*[^=]*(passed|failed|error)[^=]* in [0-9.]+s' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  if [ "$status" -eq 0 ]; then
    verdict=passed
  else
    verdict=FAILED
    failed=1
    [ "$status" -eq 124 ] && summary="timed out after ${LIMIT}s; $summary"
  fi
  ROWS+=("$(printf '%-24s %-8s %7ss  %s' "$setting" "$verdict" "$seconds" "kernels ${capability:-?}; ${summary:-see $log}")")
  echo "${ROWS[-1]}"
done

echo
echo "portability of the numerics tests on $("$PYTHON" -c 'from lifeofprompt.env import cpu_model; print(cpu_model())' 2>/dev/null || uname -m) (logs: $LOGS)"
printf '%-24s %-8s %8s  %s\n' setting result time details
for row in "${ROWS[@]}"; do
  echo "$row"
done
exit "$failed"
