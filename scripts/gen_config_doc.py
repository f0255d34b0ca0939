"""Writes docs/CONFIG.md from c10d_ext/config.py (tests/project/test_config.py checks that it is current)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from c10d_ext import config  # noqa: E402

with open(os.path.join(ROOT, "docs", "CONFIG.md"), "w") as f:
    f.write(config.markdown())
print("wrote docs/CONFIG.md")
