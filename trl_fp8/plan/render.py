"""A memory plan as a table: rich in a terminal (plain text without rich), Markdown for the docs, JSON for scripts."""

from __future__ import annotations

import json

from ..memory import GENERATION, PERSISTENT, TRAINING, bytes_text
from .plan import Plan, method_name
from .rows import BACKWARD, FORWARD

PHASE_TEXT = {PERSISTENT: "held", TRAINING: "training", GENERATION: "generation"}
OWNER_TEXT = {"model": "model", "trainer": "trainer (TRL)", "engine": "vLLM engine"}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def title(plan: Plan) -> str:
    s = plan.spec
    r = s.rollout
    settings = [method_name(s), f"fair_cast={getattr(s.args, 'fair_cast', 'off')}"]
    if s.lora is not None and getattr(s.args, "fair_cast", "off") != "off":
        settings.append(f"lora_serving={s.lora_serving}")
    settings += [f"sync_checks={getattr(s.args, 'sync_checks', 'default')}",
                 f"duet={'on' if getattr(s.args, 'duet', False) else 'off'}",
                 f"vllm={s.vllm}", f"gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}",
                 f"{s.extra.get('precision')}", f"{'8-bit ' if s.optimizer == 'adamw_8bit' else ''}AdamW"]
    shape = (f"{r.generation_batch} rollouts × ({r.prompt_length} prompt + {r.completion_length} completion) tokens, "
             f"{r.micro_batch} per micro-batch")
    return f"{s.arch.name} on {s.device.name} ({s.device.note or bytes_text(s.device.usable)})\n" \
           f"{', '.join(settings)}\n{shape}"


def summary_lines(plan: Plan) -> list[str]:
    """The totals, the verdict (``fits: yes`` / ``fits: no``), and what would make it fit."""
    lines = []
    for gpu, t in plan.totals.items():
        card = "trainer card" if gpu == 0 else f"card {gpu} (vLLM server)"
        if gpu == 0:
            lines.append(f"{card}: held {bytes_text(t['persistent'])} + peak of training "
                         f"{bytes_text(t['training'])} (forward {bytes_text(t['training_forward'])}, backward "
                         f"{bytes_text(t['training_backward'])}) / generation {bytes_text(t['generation'])} + CUDA context "
                         f"~{bytes_text(t['cuda_context'])} + allocator slack ~{bytes_text(t['allocator_slack'])}")
        lines.append(f"total ({card}): {bytes_text(t['total'])} of {bytes_text(t['usable'])} usable")
    lines.append(f"fits: {'yes' if plan.fits else 'no'}")
    if not plan.fits:
        lines += [f"why: {p}" for p in plan.problems]
        lines.append("largest items: " + "; ".join(f"{r.item} {bytes_text(r.bytes)}" for r in plan.largest(3)))
        if plan.suggestion:
            lines.append(f"the one change that would make it fit: {plan.suggestion}")
    lines += [f"note: {n}" for n in plan.notes]
    return lines


def _rows(plan: Plan):
    for row in plan.rows:
        owner = OWNER_TEXT.get(row.owner, row.owner)
        where = f"{owner}" + (f" (card {row.gpu})" if row.gpu else "")
        flags = ("~" if not row.exact else "") + ("elastic" if row.elastic else "")
        when = PHASE_TEXT[row.phase] + (f" ({row.note})" if row.note in (FORWARD, BACKWARD) else "")
        yield where, row.item, row.per, when, _gib(row.bytes), flags


def markdown(plan: Plan) -> str:
    lines = ["| who | what | per | when | GiB |", "|---|---|---|---|---:|"]
    for where, item, per, phase, gib, flags in _rows(plan):
        mark = " (est.)" if "~" in flags else ""
        mark += " (elastic)" if "elastic" in flags else ""
        lines.append(f"| {where} | {item}{mark} | {per} | {phase} | {gib} |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {line}" if not line.startswith("fits") else f"- **{line}**"
                                                   for line in summary_lines(plan)) + "\n"


def text(plan: Plan) -> str:
    rows = list(_rows(plan))
    widths = [max(len(str(r[i])) for r in rows + [("who", "what", "per", "when", "GiB", "")]) for i in range(6)]
    fmt = "  ".join(f"{{:{'>' if i == 4 else '<'}{w}}}" for i, w in enumerate(widths))
    out = [title(plan), "", fmt.format("who", "what", "per", "when", "GiB", "")]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(out + [""] + summary_lines(plan))


def print_rich(plan: Plan, file=None) -> None:
    """The plan as a rich table (plain text when rich is not installed)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with transformers/accelerate; a bare install prints plain text
        print(text(plan), file=file)
        return
    console = Console(file=file, width=170, highlight=False)
    table = Table(title=title(plan), title_justify="left", show_lines=False)
    for name, justify in (("who", "left"), ("what", "left"), ("per", "left"), ("when", "left"), ("GiB", "right")):
        table.add_column(name, justify=justify, overflow="fold")
    for where, item, per, phase, gib, flags in _rows(plan):
        mark = (" ~est." if "~" in flags else "") + (" (elastic)" if "elastic" in flags else "")
        table.add_row(where, item + mark, per, phase, gib)
    console.print(table)
    for line in summary_lines(plan):
        style = None
        if line.startswith("fits:"):
            style = "bold green" if plan.fits else "bold red"
        console.print(line, style=style, markup=False)


def as_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2)
