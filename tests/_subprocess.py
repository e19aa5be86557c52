"""Run a test script in a fresh interpreter, with RSS made honest (DESIGN.md fact 11)."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap


def run_script(source: str, timeout: float = 300) -> dict:
    """Run ``source`` in a new Python; it must print one JSON object as its last line.

    The source is a file (TorchScript reads the source of the functions it compiles).
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "script.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent(source))
        proc = subprocess.run(
            [sys.executable, path],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
