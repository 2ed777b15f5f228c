"""What DUET allocates: its rows of the memory plan (``trl-fp8 plan``). A pure function of the plan's spec.

DUET keeps per-prompt statistics and length quantiles in Python (host memory, a few numbers per prompt) and one
stopping criterion per generation call; it holds no tensor on the GPU. It generates only the planned rollouts, so the
KV cache of a step is at most that of TRL's full group (the plan counts the full group: the worst case, e.g. a cold
start). With a token-sum loss (``dapo``, the default, ``cispo``, ``vespo``) the loss forward skips the placeholder
and aborted rows: on average a β share of the batch, but the budget is in tokens, and a step whose prompts all expect
short rollouts can fill every slot, so the plan — an upper bound — keeps the full micro-batch for the loss.
"""

from __future__ import annotations

from ..memory import PERSISTENT, Row


def memory_rows(spec) -> list[Row]:
    return [Row("DUET controller (per-prompt statistics, host memory)", 0,
                "0 B on the GPU: O(prompts) Python numbers", PERSISTENT, "duet", "duet/state")]
