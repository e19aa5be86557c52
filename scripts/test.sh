#!/usr/bin/env bash
# The whole test suite: unit tests, doctests, examples, op sweep, 200k-node depth.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" -m pytest "$@"
