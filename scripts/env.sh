# Sourced by scripts/demo.sh and scripts/test.sh: make .venv once, idempotently.
# torch is pinned to 2.13.0, whose CPU wheel these machines hold; an unpinned torch
# would pull a multi-GB CUDA build. setup.cfg keeps the range real users can meet.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.graphprune-installed"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test,bench]"
    # LibMTL's unmodified weighting classes (tests/test_libraries.py): it declares torchvision,
    # which would replace the pinned torch; the classes need torch, numpy and scipy only
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "LibMTL==1.1.5"
    echo "$WANT" > "$STAMP"
fi
export MALLOC_MMAP_THRESHOLD_=65536  # honest RSS readings (DESIGN.md fact 11)
cd "$ROOT"
