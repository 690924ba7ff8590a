#!/usr/bin/env bash
# Set up, then run the default test suite (slow and GPU tests excluded; add `-m slow` or `-m gpu` to run those).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m pytest "$@"
