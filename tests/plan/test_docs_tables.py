"""docs/will-it-fit.md shows what `trl-fp8 plan` prints: each table and verdict there is the command's output now
(regenerate a table with the command named above it, `--markdown`)."""

import os

import pytest

from trl_fp8.app.cli import main

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "will-it-fit.md")
COMMANDS = [  # (what the page shows: the whole table or the summary lines, the command)
    ("table", ["--model", "qwen2.5-7b", "--qlora", "--device", "t4"]),
    ("table", ["--model", "qwen2.5-7b", "--qlora", "--device", "2xt4", "--vllm", "server"]),
    ("table", ["--model", "smollm2-135m", "--full", "--device", "t4"]),
    ("table", ["--model", "qwen2.5-1.5b", "--lora-r", "16", "--device", "t4"]),
    ("summary", ["--model", "llama-3.1-8b", "--qlora", "--device", "t4"]),
    ("summary", ["--model", "qwen2.5-7b", "--qlora", "--device", "t4", "--vllm", "colocate"]),
    ("summary", ["--model", "qwen2.5-7b", "--device", "t4"]),
]


@pytest.mark.parametrize("kind, argv", COMMANDS, ids=[" ".join(argv) for _, argv in COMMANDS])
def test_the_page_shows_the_command_s_output(capsys, kind, argv):
    with open(DOC, encoding="utf-8") as f:
        page = f.read()
    assert main(["plan", *argv, "--markdown"]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    if kind == "summary":
        out = "\n".join(line for line in out.splitlines() if line.startswith("- "))
    assert out in page, f"docs/will-it-fit.md is stale: regenerate with trl-fp8 plan {' '.join(argv)} --markdown"
