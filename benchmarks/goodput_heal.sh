#!/usr/bin/env bash
# Issue #43's goodput table (BENCHMARKS.md, "Fault tolerance"): healing in place (as a user gets it),
# today's full restart and torchft, 2 and 4 ranks, DDP and FSDP2 (dp_shard), a random kill every 30 s,
# 3000 steps, one run after another. Ten runs: about an hour and a half on 2 cores (estimated from
# the 2-rank short form; not run whole yet). torchft comes from the bench group (scripts/install.sh
# bench); without it its rows are left out, said in one line.
# The short form, to check it works (a few minutes):
#   PYTHONPATH=src:. python -m benchmarks.goodput --worlds 2 --layouts ddp --steps 300 --kill-every-s 10
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:.
out=${1:-benchmarks/results}
python -m benchmarks.goodput --worlds 2,4 --layouts ddp,dp_shard --modes heal,disk,torchft --kill-every-s 30 \
    --steps 3000 --every 50 --json "$out/goodput-heal.json"
