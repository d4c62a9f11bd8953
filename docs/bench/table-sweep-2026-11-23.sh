#!/usr/bin/env bash
# The sweep behind docs/benchmarks.md's chart: table design vs the naive baseline, 18 points, each
# measured with the naive baseline in the same run. Run once on 2026-11-23, 20:07-20:16 UTC.
# Then: .venv/bin/python benchmarks/chart.py docs/bench/table-sweep-2026-11-23.jsonl -o docs/bench/table-sweep-2026-11-23.svg --caption ...
set -u
cd "$(dirname "$0")/../.."
OUT=docs/bench/table-sweep-2026-11-23.jsonl
LOG=docs/bench/table-sweep-2026-11-23.log
: > "$OUT"; : > "$LOG"
echo "start $(date -u +%FT%TZ) $(uptime)" >> "$LOG"
for sem in at-most-once at-least-once; do
  for pc in 1 2 4; do
    echo "== $sem ${pc}x${pc} $(date -u +%T) $(uptime)" >> "$LOG"
    .venv/bin/python benchmarks/run.py --design table --semantics "$sem" --producers "$pc" --consumers "$pc" \
      --seconds 3 --json >> "$OUT" 2>> "$LOG" || echo "EXIT $? for $sem $pc" >> "$LOG"
  done
done
echo "end $(date -u +%FT%TZ) $(uptime)" >> "$LOG"
