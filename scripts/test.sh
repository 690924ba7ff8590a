#!/usr/bin/env bash
# Set up, then run the test suite as CI does: every test but the GPU ones, slow ones included. Narrow it with
# pytest's own options, e.g. `-m "not slow and not gpu"` (the quick run a bare `pytest` does) or `-m gpu`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m pytest -m "not gpu" "$@"
