#!/usr/bin/env bash
# The whole test suite, notebooks and browser tests included. Installs what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --browser
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest tests notebooks -p no:cacheprovider \
  --nbval-lax --nbval-current-env --nbval-cell-timeout=900 --nbval-kernel-startup-timeout=120 \
  --timeout=1800 -ra "$@"
