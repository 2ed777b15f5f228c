"""Memory as data, shared by the plan and the capabilities (a neutral module: it imports nothing of trl_fp8, nor
torch): a :class:`Row` of a memory plan — what is allocated, how many bytes, per parameter of what, when it is alive
— which each capability states for itself (``Capability.memory_rows``, :mod:`trl_fp8.plan`), and the storage count
that checks the rows against a live trainer (``Capability.held_tensors``, :func:`trl_fp8.plan.measure`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# When a row's bytes are alive. The plan's peak is the persistent rows plus the larger of the two transient phases.
PERSISTENT = "persistent"  # from set-up to the end of training (weights, optimizer state, served copies)
TRAINING = "training"  # during a loss forward/backward and the optimizer step (activations, gradients, logits)
GENERATION = "generation"  # while rollouts are generated (KV cache, rollout cache, sync buffers)
PHASES = (PERSISTENT, TRAINING, GENERATION)

GIB = 2**30
MIB = 2**20
FP32, HALF = 4, 2  # element bytes of fp32 and of a 16-bit dtype (bf16, fp16)


@dataclass(frozen=True)
class Row:
    """``bytes`` of ``item``, counted as ``per`` says (e.g. ``"4 B × adapter params (40.4 M)"``).

    ``owner``: who allocates it (``model``, ``trainer``, a capability's name, ``engine``, ``cuda``); ``category``: the
    :func:`trl_fp8.plan.measure` category it is checked against (None: not measurable as a held tensor); ``gpu``:
    which card (1: a vLLM server's second GPU); ``exact``: counted as the code allocates it (False: an estimate);
    ``elastic``: sized at run time to the memory left free (it cannot make the run not fit)."""

    item: str
    bytes: int
    per: str
    phase: str = PERSISTENT
    owner: str = "model"
    category: str | None = None
    gpu: int = 0
    exact: bool = True
    elastic: bool = False
    note: str = ""

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"Row.phase must be one of {', '.join(PHASES)}, got {self.phase!r}.")
        if self.bytes < 0:
            raise ValueError(f"Row {self.item!r}: negative bytes {self.bytes}.")

    def as_dict(self) -> dict:
        return asdict(self)


def count_text(n: int | float) -> str:
    """``40_370_176`` -> ``"40.4 M"``; ``7.6e9`` -> ``"7.62 G"``."""
    n = float(n)
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n:.0f}"


def bytes_text(n: int | float) -> str:
    """Bytes for people: GiB above 1 GiB, else MiB, else KiB / B."""
    n = float(n)
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n:.0f} B"


def per(element_bytes: float, what: str, count: int | float) -> str:
    """``per(4, "adapter params", 40.4e6)`` -> ``"4 B × adapter params (40.4 M)"``."""
    size = f"{element_bytes:g} B" if element_bytes >= 1 else f"1/{1 / element_bytes:g} B"
    return f"{size} × {what} ({count_text(count)})"


# -- counting what is held ------------------------------------------------------------------------------------------
def storage_key(t):
    """One key per tensor storage: its data pointer, or (on the meta device, where every pointer is 0) the storage
    itself, so views and aliases of one storage share a key."""
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    return (t.device.type, ptr) if ptr else ("storage", storage._cdata)


class StorageCounter:
    """Sums the bytes of distinct storages by category; a storage already counted adds nothing."""

    def __init__(self):
        self.seen: set = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, tensors) -> None:
        self.bytes.setdefault(category, 0)
        for t in tensors:
            if t is None or not hasattr(t, "untyped_storage"):
                continue
            k = storage_key(t)
            if k in self.seen:
                continue
            self.seen.add(k)
            self.bytes[category] += t.untyped_storage().nbytes()


def quant_state_tensors(param) -> list:
    """The tensors of a bitsandbytes ``Params4bit``'s quantization state and its nested state (absmax, codes,
    offset), if it has one."""
    out, state = [], getattr(param, "quant_state", None)
    while state is not None:
        out += [v for v in vars(state).values() if hasattr(v, "untyped_storage")]
        state = getattr(state, "state2", None)
    return out
