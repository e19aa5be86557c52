#!/usr/bin/env bash
# The README's pictures (docs/*.svg), made from its examples: graphs and memory timeline.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" docs/make.py "$@"
