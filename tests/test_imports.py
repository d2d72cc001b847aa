"""The packages import in either order, and the public names resolve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("first", ["passes", "tess_compile"])
def test_import_order_and_public_names(first):
    code = (
        f"import {first}, passes, tess_compile\n"
        "names = [getattr(tess_compile, n) for n in tess_compile.__all__]\n"
        "assert all(callable(v) for v in names), names\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
