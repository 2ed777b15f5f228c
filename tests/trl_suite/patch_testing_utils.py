"""TRL's tests/testing_utils.py at HEAD may import availability helpers that the installed (pinned) TRL does not
have yet; each missing one becomes a helper answering False (the optional dependency counts as absent)."""

import re
import sys

path = sys.argv[1]
text = open(path, encoding="utf-8").read()
block = re.search(r"from trl\.import_utils import \(\n(.*?)\)\n", text, re.S)
if block:
    names = [line.strip().rstrip(",") for line in block.group(1).splitlines() if line.strip()]
    lines = ["import trl.import_utils as _trl_import_utils"]
    lines += [f"{n} = getattr(_trl_import_utils, {n!r}, lambda *args, **kwargs: False)" for n in names]
    text = text.replace(block.group(0), "\n".join(lines) + "\n")
    open(path, "w", encoding="utf-8").write(text)
