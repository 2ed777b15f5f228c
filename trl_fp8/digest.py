"""Content digests of tensors and tokenizers, computed where the data lives (a GPU, a CPU, a vLLM worker) and
compared as short strings: what the served-identity checks send instead of the tensors themselves.

A tensor's digest is ``Σ_i w_i · bits_i mod 2⁶⁴`` over its elements' raw bits read as integers, with ``w_i`` an odd
pseudo-random weight of the element's position, plus its dtype and shape. Integer arithmetic is exact on every device,
so the same bits give the same digest on a GPU, a CPU or in another process; any one element changed (by any bit)
changes it (``w_i`` odd, the change below 2⁶⁴), and several changes cancel with probability about 2⁻⁶⁴. It guards
against faults, not adversaries. Pure torch; it reads the tensor in chunks (no full-size temporary).
"""

from __future__ import annotations

import hashlib
import json

import torch

CHUNK_ELEMENTS = 1 << 22  # elements per chunk: an int64 temporary of 32 MiB at most
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (the golden-ratio multiplier)
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64 (splitmix64's first multiplier)


_WEIGHTS: dict = {}  # device -> the odd weights of one chunk's positions


def _mix(i: torch.Tensor) -> torch.Tensor:
    """An odd pseudo-random int64 of each int64 (wraps mod 2⁶⁴, the same on every device)."""
    w = (i + 1) * _MIX
    w = (w ^ (w >> 31)) * _MIX2
    return w | 1


def _chunk_weights(device) -> torch.Tensor:
    key = str(device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = _mix(torch.arange(CHUNK_ELEMENTS, dtype=torch.int64, device=device))
    return _WEIGHTS[key]


@torch.no_grad()
def tensor_digest(tensor: torch.Tensor) -> str:
    """``dtype:shape:hex`` of ``tensor``'s content (see the module docstring); a meta tensor has no content and is
    refused by name. Chunk ``c``'s weighted sum ``S_c = Σ_j w_j · bits_(c·C+j)`` enters as ``m_c · S_c`` with ``m_c``
    odd too, so one weight table serves every chunk and a change anywhere still changes the digest."""
    if tensor.is_meta:
        raise ValueError("a meta tensor has no content to digest (its parameters were never materialised)")
    t = tensor.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    flat = t.contiguous().reshape(-1)
    n = flat.numel()
    total = 0
    if n:
        bits = flat.view(_INT[flat.element_size()])
        weights = _chunk_weights(flat.device)
        sums = []
        for start in range(0, n, CHUNK_ELEMENTS):
            chunk = bits[start:start + CHUNK_ELEMENTS]
            sums.append((chunk.to(torch.int64) * weights[:chunk.numel()]).sum())
        chunk_sums = torch.stack(sums)
        factors = _mix(torch.arange(len(sums), dtype=torch.int64, device=flat.device) + (1 << 40))
        total = int((chunk_sums * factors).sum().item())
    value = total & (2 ** 64 - 1)
    shape = "x".join(map(str, tensor.shape))
    return f"{str(tensor.dtype).removeprefix('torch.')}:{shape}:{value:016x}"


def tokenizer_digest(tokenizer) -> str:
    """A digest of what a tokenizer maps text to: its vocabulary (token -> id, added tokens included) and its special
    tokens' ids. Two tokenizers with the same digest encode every text the same way up to their normalisers."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    special = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                        "unk_token_id")}
    blob = json.dumps({"vocab": sorted(vocab.items(), key=lambda kv: kv[1]), "special": special},
                      sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
