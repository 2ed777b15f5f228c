"""Count the raise sites of a package whose message no test checks.

A *raise site* is a ``raise`` statement in the package's source. Its *message* is the literal text of the exception's
first argument: a string constant, or the constant parts of an f-string (``f"budget_s must be > 0, got {x}"`` gives
``"budget_s must be > 0, got "``), or of a ``+``/implicit concatenation of those. A site is *tested* when one of
its message fragments of at least ``--min-chars`` characters (default 12) has a piece of ``--window`` consecutive
characters (default 24; the whole fragment when shorter) that appears in the text of a test file: a
``pytest.raises(..., match=...)`` pattern, an ``assert "..." in str(err)``, a message compared in full (tests match
a part of a message, so a part is looked for). Regex
escapes in the tests (``\\(``, ``\\.``, ...) are undone before the comparison, and fragments are compared after
collapsing whitespace, so a message wrapped over two source lines or matched with ``re.escape``-style escapes still
counts. Shorter fragments (``f"{name}: {value}"``) cannot be told apart from other text and make a site *unjudged*.

Three kinds of site have no message to test, and are listed apart:

- a bare ``raise`` (re-raises the exception being handled) and ``raise err`` / ``raise SomeError from err`` where
  the exception is a name, not a call (it re-raises or forwards one built elsewhere);
- ``raise SomeError()`` with no argument, or with an argument that is not text (a variable, a call).

Of several arguments, the one with the most literal text is the message (``WeightSyncError(check, message)``).

The count is a heuristic (a fragment may appear in a test for another reason; a message built entirely at run time
is unjudged), but it is exact about what it reports: every site it calls untested has no fragment in any test.

    python tools/raise_sites.py [--package trl_fp8] [--tests tests] [--min-chars 12] [--window 24] [--list]

Last line: ``raise_sites_without_a_message_test: N`` (of M raise sites with a message).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from dataclasses import dataclass, field


@dataclass
class RaiseSite:
    path: str
    line: int
    exception: str  # the exception's name as written (``ValueError``, ``WeightSyncError``), or "" when none
    kind: str  # "message" | "reraise" | "no_text"
    fragments: list[str] = field(default_factory=list)  # the literal parts of the message, whitespace collapsed


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _literal_parts(node: ast.AST) -> list[str] | None:
    """The literal text parts of a message expression, or None when it has no literal text at all."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts, current = [], ""
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                current += value.value
            else:  # a formatted value splits the literal text
                parts.append(current)
                current = ""
        parts.append(current)
        return [p for p in parts if p] or None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left = _literal_parts(node.left) or []
        right = _literal_parts(node.right) if isinstance(node.op, ast.Add) else []
        return (left + (right or [])) or None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _literal_parts(node.func.value)
    return None


def _exception_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def raise_sites(package_dir: str) -> list[RaiseSite]:
    """Every ``raise`` statement under ``package_dir`` (``.py`` files), in path and line order."""
    sites = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), filename=path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Raise):
                    continue
                exc = node.exc
                if exc is None or not isinstance(exc, ast.Call):
                    sites.append(RaiseSite(path, node.lineno, _exception_name(exc) if exc else "", "reraise"))
                    continue
                args = list(exc.args) + [k.value for k in exc.keywords if k.arg in ("msg", "message")]
                # the message is the argument with the most literal text (WeightSyncError(check, message))
                candidates = [_literal_parts(arg) or [] for arg in args]
                parts = max(candidates, key=lambda c: len("".join(c)), default=[])
                fragments = [_collapse(p) for p in parts if _collapse(p)]
                sites.append(RaiseSite(path, node.lineno, _exception_name(exc.func),
                                       "message" if fragments else "no_text", fragments))
    sites.sort(key=lambda s: (s.path, s.line))
    return sites


_REGEX_ESCAPE = re.compile(r"\\([^A-Za-z0-9])")


def tests_text(tests_dir: str) -> str:
    """The text of every ``.py`` file under ``tests_dir``, with regex escapes of punctuation undone and whitespace
    collapsed (so patterns given to ``pytest.raises(match=...)`` read as the messages they match)."""
    chunks = []
    for root, dirs, files in os.walk(tests_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8") as fh:
                    chunks.append(fh.read())
    text = "\n".join(chunks)
    text = text.replace("\\\\", "\\")  # "\\(" in a non-raw string is the regex escape \(
    text = _REGEX_ESCAPE.sub(r"\1", text)
    return _collapse(text)


def judge(site: RaiseSite, text: str, min_chars: int, window: int) -> str:
    """"tested" when ``text`` holds a piece of the message: ``window`` consecutive characters of one of its fragments
    (all of a fragment of ``min_chars`` to ``window`` characters); "untested" when some fragment is at least
    ``min_chars`` long but no piece of it appears; "unjudged" when every fragment is shorter."""
    long_enough = [f for f in site.fragments if len(f) >= min_chars]
    if not long_enough:
        return "unjudged"
    for fragment in long_enough:
        width = min(window, len(fragment))
        if any(fragment[i:i + width] in text for i in range(len(fragment) - width + 1)):
            return "tested"
    return "untested"


def main(argv=None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default=os.path.join(here, "trl_fp8"))
    parser.add_argument("--tests", default=os.path.join(here, "tests"))
    parser.add_argument("--min-chars", type=int, default=12)
    parser.add_argument("--window", type=int, default=24)
    parser.add_argument("--list", action="store_true", help="list every untested and unjudged site")
    args = parser.parse_args(argv)
    if args.min_chars < 1:
        parser.error(f"--min-chars must be >= 1, got {args.min_chars}")
    if args.window < args.min_chars:
        parser.error(f"--window must be >= --min-chars ({args.min_chars}), got {args.window}")
    for label, folder in (("--package", args.package), ("--tests", args.tests)):
        if not os.path.isdir(folder):
            parser.error(f"{label} must name a folder, got {folder!r}")

    sites = raise_sites(args.package)
    text = tests_text(args.tests)
    verdicts = {"tested": [], "untested": [], "unjudged": []}
    for site in sites:
        if site.kind == "message":
            verdicts[judge(site, text, args.min_chars, args.window)].append(site)
    reraise = [s for s in sites if s.kind == "reraise"]
    no_text = [s for s in sites if s.kind == "no_text"]
    base = os.path.dirname(os.path.abspath(args.package))
    if args.list:
        for verdict in ("untested", "unjudged"):
            for site in verdicts[verdict]:
                print(f"{verdict:>8} {os.path.relpath(site.path, base)}:{site.line} {site.exception}: "
                      f"{' … '.join(site.fragments)[:110]}")
    with_message = sum(len(v) for v in verdicts.values())
    print(f"raise sites: {len(sites)} (re-raise / forward an exception: {len(reraise)}; no message text: "
          f"{len(no_text)}; with a message: {with_message})")
    print(f"with a message: tested {len(verdicts['tested'])}, untested {len(verdicts['untested'])}, unjudged "
          f"(only fragments under {args.min_chars} characters) {len(verdicts['unjudged'])}")
    print(f"raise_sites_without_a_message_test: {len(verdicts['untested'])} (of {with_message} raise sites with a "
          "message)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
