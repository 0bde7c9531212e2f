#!/usr/bin/env bash
# Healing in place against restarts and torchft, one session (BENCHMARKS.md, "Healing in place").
# About 40 minutes on 2 cores; torchft comes from the bench group (scripts/install.sh bench).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:.
out=${1:-benchmarks/results}
python -m benchmarks.goodput --worlds 2 --modes disk,snapshots,heal --period-s 30 --steps 3000 --every 50 --json "$out/goodput-heal-2.json"
python -m benchmarks.goodput --worlds 4 --modes disk,heal --period-s 30 --steps 3000 --every 50 --json "$out/goodput-heal-4.json"
python -m benchmarks.torchft_goodput --replicas 2,4 --period-s 30 --steps 3000 --json "$out/goodput-torchft.json"
