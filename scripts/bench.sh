#!/usr/bin/env bash
# The benchmark suite: writes benchmarks/RESULTS.md and the plots (--quick, --device cuda).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" -m benchmarks "$@"
