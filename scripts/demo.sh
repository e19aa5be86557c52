#!/usr/bin/env bash
# The main job: show the memory a prune gives back, measured in this process.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" examples/demo.py "$@"
