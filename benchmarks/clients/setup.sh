#!/usr/bin/env bash
# One venv per client under ${LIFEOFPROMPT_CACHE:-~/.cache/lifeofprompt}/clients/<client>, never in the project's .venv:
# pip's dry run shows aiperf would downgrade transformers and huggingface-hub there, and instructor openai.
#   bash benchmarks/clients/setup.sh                  all clients
#   bash benchmarks/clients/setup.sh guidellm lm-eval  some of them
# Safe to run again: a venv whose client already imports is left as it is. Each install is constrained by
# lock/<client>.txt (the exact versions it was run with) when that file exists; `--relock` rewrites it.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="${LIFEOFPROMPT_CACHE:-$HOME/.cache/lifeofprompt}/clients"
PY=${CLIENTS_PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
RELOCK=0
ALL=(guidellm aiperf lm-eval instructor langchain-openai)
ARGS=()
for a in "$@"; do [ "$a" = --relock ] && RELOCK=1 || ARGS+=("$a"); done
[ ${#ARGS[@]} -gt 0 ] || ARGS=("${ALL[@]}")

# What each venv gets: the client pinned, plus what its run needs.
requirements() {
  case "$1" in
    # guidellm depends on torch: the CPU build first, as scripts/setup.sh pins it (else pip takes 6 GB of CUDA wheels).
    guidellm) echo "torch==2.13.0 guidellm==0.8.1" ;;
    aiperf) echo "aiperf==0.13.0" ;;
    # local-completions needs the api extra; its huggingface tokenizer backend needs transformers (not torch).
    lm-eval) echo "lm-eval[api]==0.4.13 transformers==5.25.0" ;;
    instructor) echo "instructor==1.17.0" ;;
    langchain-openai) echo "langchain-openai==1.7.4" ;;
    *) echo "unknown client: $1 (one of: ${ALL[*]})" >&2; return 1 ;;
  esac
}
# The module whose import proves the venv is ready.
probe() {
  case "$1" in
    lm-eval) echo lm_eval ;;
    langchain-openai) echo langchain_openai ;;
    *) echo "$1" ;;
  esac
}

mkdir -p "$ROOT" "$HERE/lock"
for client in "${ARGS[@]}"; do
  reqs=$(requirements "$client")
  venv="$ROOT/$client"
  if [ "$RELOCK" = 0 ] && [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import $(probe "$client")" 2>/dev/null; then
    echo "$client: ready in $venv"
    continue
  fi
  start=$(date +%s)
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  lock="$HERE/lock/$client.txt"
  constraint=()
  [ "$RELOCK" = 0 ] && [ -f "$lock" ] && constraint=(-c "$lock")
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${constraint[@]}" $reqs
  # A local tag (torch's +cpu) is dropped: ==2.13.0 still matches the CPU build here, and is on every index.
  "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^pip==' | sed 's/+[a-z0-9.]*$//' >"$lock.new"
  mv "$lock.new" "$lock"
  size=$(du -sh "$venv" | cut -f1)
  echo "$client: installed in $(($(date +%s) - start)) s, $size, in $venv ($(wc -l <"$lock") packages, lock/$client.txt)"
done
