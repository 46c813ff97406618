#!/usr/bin/env bash
# Installs moembed with its test dependencies and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# pytest exits 5 when it collected no test: that must fail, not pass silently.
python3 -m pytest -q -p no:cacheprovider "$@"
