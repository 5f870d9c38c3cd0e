"""scripts/gpu_suite.sh: every part is listed in its usage line, every listed part has a block, and no part name
has two blocks of its own (a second `if [[ $PART == NAME ]]` block would run both under one name)."""

from __future__ import annotations

import collections
import re
from pathlib import Path

SUITE = Path(__file__).resolve().parents[1] / "scripts" / "gpu_suite.sh"


def test_gpu_suite_parts_are_listed_and_unique():
    text = SUITE.read_text()
    usage = set(re.search(r"gpu_suite\.sh \[([^\]]+)\]", text).group(1).split("|"))
    named = set(re.findall(r"\$PART == ([A-Za-z0-9_]+)", text))
    assert named == usage, f"blocks without a usage entry: {sorted(named - usage)}; listed without a block: " \
                           f"{sorted(usage - named)}"
    sole = collections.Counter(re.findall(r"^if \[\[ \$PART == ([A-Za-z0-9_]+) \]\]; then$", text, flags=re.M))
    twice = sorted(name for name, n in sole.items() if n > 1)
    assert not twice, f"parts with two blocks of their own: {twice}"
