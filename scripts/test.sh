#!/usr/bin/env bash
# The whole test suite, notebooks and browser tests included, after ruff (lint and format) and scripts/lint.py.
# Installs what is missing first.
#   bash scripts/test.sh            everything
#   bash scripts/test.sh --quick    ruff and the unit tests: no notebooks, browser, spawned ranks or slow tests
# Arguments after these go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
if [ "$quick" = 1 ]; then bash scripts/setup.sh; else bash scripts/setup.sh --browser; fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python scripts/lint.py  # the repository's own rules (chapter length, links, exercises, short functions)
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false
# pytest rewrites the asserts of every module of a plugin's package (all of hypothesis and schemathesis) when it
# finds plugins by their entry points, and without bytecode it redoes that, and each test file's, in every process:
# about 10 of the 18 s each worker spent collecting. So plugins are named, and rewritten files are kept.
unset PYTHONDONTWRITEBYTECODE
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
plugins=(-p xdist.plugin -p pytest_timeout -p _hypothesis_pytestplugin)
# Two pytest workers where there are two cores (CI has two): measured faster than one on 2-core machines
# (benchmarks/NOTES.md, "The test tiers"). The whole suite keeps a file's tests on one worker (--dist loadfile), so
# a notebook's cells run in order in one kernel; the quick tier lets an idle worker take tests from the other's
# files (--dist worksteal; 2 min 39 s against 3 min 6 s, back to back). LIFEOFPROMPT_TEST_WORKERS=N asks for N.
workers=${LIFEOFPROMPT_TEST_WORKERS:-$(( $(nproc) < 2 ? 1 : 2 ))}
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile)
  if [ "$quick" = 1 ]; then parallel=(-n "$workers" --dist worksteal); fi
fi
if [ "$quick" = 1 ]; then
  exec .venv/bin/python -m pytest tests -p no:cacheprovider "${plugins[@]}" -m "not browser and not ranks and not slow and not gpu" \
    "${parallel[@]}" --timeout=600 -q -ra "$@"
fi
exec .venv/bin/python -m pytest tests notebooks -p no:cacheprovider "${plugins[@]}" -p nbval.plugin "${parallel[@]}" \
  --nbval-lax --nbval-current-env --nbval-cell-timeout=900 --nbval-kernel-startup-timeout=120 \
  --timeout=1800 -ra "$@"
