#!/bin/bash
# What metrics and tracing cost an echo job in instructions, which other load on the machine
# does not change (issue 20, acceptance 4): one drain of N1 and one of N2 echo jobs under
# `valgrind --tool=callgrind` for each side, the difference over N2 - N1 jobs.
# Usage: bench/observe_instructions.sh [off|metrics|tracing|on ...]   (from the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
n1=${N1:-300} n2=${N2:-1300}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for which in "${@:-off on}"; do
  totals=()
  for n in "$n1" "$n2"; do
    PYTHONPATH=. valgrind --tool=callgrind --callgrind-out-file="$out/cg" \
      .venv/bin/python bench/_observe_drain.py "$which" "$n" >/dev/null 2>&1
    totals+=("$(awk '/^(summary|totals):/ {print $2; exit}' "$out/cg")")
  done
  echo "$which $(( (totals[1] - totals[0]) / (n2 - n1) )) instructions/job"
done
