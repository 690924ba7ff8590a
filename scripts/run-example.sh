#!/usr/bin/env bash
# Set up, then run the whole pipeline (scan, encode, train, export) on the bundled example with `dvc repro`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
dvc repro "$@"
echo
echo "LoRA written to artifacts/; metrics: dvc metrics show; loss curve: dvc plots show"
