"""Bit-for-bit comparison of tensors, as the weight-sync checks compare what the learner means the sampler to hold
with what it holds: fast where it runs on every sync.

- Host tensors of one dtype, or an fp32 tensor against a bf16 one widened exactly, are compared in one call into the
  compiled CPU kernels (:func:`trl_fp8.native.first_unequal`: no copy, no widened temporary, no thread
  pool), where a C compiler built them; other host tensors with the C library's ``memcmp``, in place.
- Elsewhere (a GPU) tensors are compared as the widest integer words that tile them, many small ones in one
  concatenation (each comparison costs a dispatch and a sync).

``torch.equal`` on a CPU costs about the same per element whatever the element's width, several times what
``memcmp`` costs, and a model of many small tensors pays the per-call overhead more than the data.
"""

from __future__ import annotations

import torch

from . import memory as _memory


def describe_diff(expected: torch.Tensor, actual: torch.Tensor) -> str:
    if expected.shape != actual.shape:
        return f"shape {tuple(expected.shape)} expected, {tuple(actual.shape)} found"
    e, a = expected.float(), actual.float()
    differ = ~((e == a) | (torch.isnan(e) & torch.isnan(a)))
    n = int(differ.sum())
    delta = (e - a).abs()[differ]
    worst = delta.max().item() if delta.numel() else float("nan")
    return f"{n} of {e.numel()} elements differ (max |Δ| {worst:.4g})"


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer dtype of each element size


def _libc_memcmp():
    """The C library's ``memcmp`` through ctypes, or None where it cannot be found."""
    import ctypes
    import ctypes.util

    for name in (None, ctypes.util.find_library("c"), "msvcrt"):
        try:
            function = ctypes.CDLL(name).memcmp
        except (OSError, AttributeError, TypeError):
            continue
        function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        function.restype = ctypes.c_int
        return function
    return None  # pragma: no cover - every supported platform has one


_MEMCMP = _libc_memcmp()
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose data_ptr() is their own strided memory


def _on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be compared in place with ``memcmp``: a plain strided CPU tensor."""
    return t.is_cpu and type(t) in _PLAIN and t.layout == torch.strided


def same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_cpu and b.is_cpu) or a.device == b.device  # the first test is the cheap common case


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs with equal payloads count as equal; +0 and -0 differ). CPU tensors are compared in
    place with the C library's ``memcmp`` (one pass, no temporary, no thread pool: ``torch.equal`` on a CPU is several
    times slower, and a small tensor pays the dispatch more than the data); elsewhere as the widest integer words that
    tile both (int64 where sizes and offsets allow: ``torch.equal`` costs about the same per element whatever its
    width)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_complex:  # a lazily conjugated or negated view: its values, not its bits
        a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.is_contiguous():
        b = b.contiguous()
    if _MEMCMP is not None and _on_host(a) and _on_host(b):
        nbytes = a.numel() * a.element_size()
        return nbytes == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), nbytes) == 0
    if a.dtype == torch.bool:  # one byte per element, 0 or 1: equal values are equal bits
        return torch.equal(a, b)
    width = a.element_size()
    if not (a.numel() * width) & 7 and not (a.storage_offset() * width) & 7 and not (b.storage_offset() * width) & 7:
        return torch.equal(a.view(-1).view(torch.int64), b.view(-1).view(torch.int64))
    bits = _BITS[width]
    return torch.equal(a.view(bits), b.view(bits))


# Off the host (or without memcmp), many small tensors are compared in groups: one concatenation per side and one
# comparison for up to this many elements (each tensor's own comparison costs a dispatch and, on a GPU, a sync); a
# larger tensor is compared alone. A tensor is widened in chunks of this many elements (no full-size temporary). The
# memory plan counts the bound (trl_fp8.sync_checks.memory).
COMPARE_GROUP_ELEMENTS = _memory.COMPARE_GROUP_ELEMENTS


def _equal_widened(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` bitwise equal to ``b`` converted to ``a``'s dtype (exact where ``b``'s dtype widens to ``a``'s; the same
    dtype: ``b`` itself)."""
    if b.dtype == a.dtype:
        return bitwise_equal(a, b)
    if a.shape != b.shape:
        return False
    n = a.numel()
    if n <= COMPARE_GROUP_ELEMENTS:
        return bitwise_equal(a, b.to(a.dtype))
    a, b = a.reshape(-1), b.reshape(-1)
    return all(bitwise_equal(a[i:i + COMPARE_GROUP_ELEMENTS], b[i:i + COMPARE_GROUP_ELEMENTS].to(a.dtype))
               for i in range(0, n, COMPARE_GROUP_ELEMENTS))


# Host pairs wait for one call into the compiled comparison until the first sides of those waiting hold this many
# bytes (the tensors are held until then: a reference the learner side computed is a fresh tensor); the memory plan
# counts it (trl_fp8.sync_checks.memory).
NATIVE_BATCH_BYTES = _memory.HOST_BATCH_BYTES


_NATIVE_MODULE = []  # trl_fp8.native once imported


def _native_module():
    """:mod:`trl_fp8.native` (imported on first use: a run on a GPU never needs it)."""
    if not _NATIVE_MODULE:
        from .. import native as _native

        _NATIVE_MODULE.append(_native)
    return _NATIVE_MODULE[0]


def _native_lib():
    """The compiled CPU kernels (:mod:`trl_fp8.native`, built on first use), or None."""
    return _native_module().load()


class StorageReleased(RuntimeError):
    """A tensor waiting in a :class:`PairComparer` lost its storage before the comparison (released or moved, as
    FSDP and ZeRO-3 release a sharded parameter's storage after a gather): its old address is never read."""

    def __init__(self, label):
        super().__init__(f"'{label}': its storage was released or moved between being queued and being compared (a "
                         "sharded parameter freed after its gather?): compare it while it is held")
        self.label = label


def _holds(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage still holds its elements (a storage resized to 0 does not)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def meta_name(pairs) -> str | None:
    """``"learner"``/``"sampler"`` for the first side of ``(learner, sampler)`` that is a meta tensor (no values),
    else None."""
    learner, sampler = pairs
    return "learner" if learner.is_meta else "sampler" if sampler.is_meta else None


class PairComparer:
    """Compares pairs ``(a, b)`` as they come: ``a`` bitwise equal to ``b`` converted to ``a``'s dtype (see
    :func:`_equal_widened`; a shape mismatch is a mismatch). Host pairs of one dtype, or fp32 against bf16, wait and
    are compared in one call into the compiled kernels (no copy, no widened temporary; :data:`NATIVE_BATCH_BYTES` at
    most held), other host pairs at once in place; elsewhere runs of small tensors of one kind wait and are compared
    together (:data:`COMPARE_GROUP_ELEMENTS` elements at most), and a larger tensor is compared at once. :meth:`add`
    returns False once a mismatch is known; :attr:`mismatch` is then the first pair that differs, as
    ``(label, a, b)`` (the first in the order added, except that host pairs are compared before device pairs)."""

    def __init__(self):
        self.mismatch: tuple | None = None
        self._group: list[tuple] = []
        self._kind, self._count = None, 0
        self._host: list[tuple] = []
        self._host_bytes = 0
        self._lib = False  # the compiled kernels, looked up (and built) when a host pair first comes

    def add(self, label, a: torch.Tensor, b: torch.Tensor) -> bool:
        if self.mismatch is not None:
            return False
        if a.is_meta or b.is_meta:
            raise ValueError(f"'{label}': a meta tensor holds no values to compare")
        if a.shape != b.shape:
            if self._flush():
                self.mismatch = (label, a, b)
            return False
        if a.is_cpu and b.is_cpu:
            if self._group and not self._flush_group():
                return False
            if self._lib is False:
                self._lib = _native_lib()
            entry = self._checked(a, b) if self._lib is not None else None
            if entry is not None:  # checked for the kernel now; waits for one call with the others
                self._host.append((label, a, b, entry))
                self._host_bytes += a.nbytes
                return self._flush_host() if self._host_bytes > NATIVE_BATCH_BYTES else True
            if self._host and not self._flush_host():  # a pair the kernel does not take: compared alone, in order
                return False
            if not _equal_widened(a, b):  # in place (memcmp) where it can be
                self.mismatch = (label, a, b)
                return False
            return True
        if self._host and not self._flush_host():
            return False
        n = a.numel()
        kind = (a.dtype, b.dtype, a.device, b.device)
        if (kind != self._kind or self._count + n > COMPARE_GROUP_ELEMENTS) and not self._flush_group():
            return False
        self._kind = kind
        self._group.append((label, a, b))
        self._count += n
        return self._flush_group() if n > COMPARE_GROUP_ELEMENTS else True

    def finish(self) -> tuple | None:
        """Compares what waits; the first mismatch, or None."""
        self._flush()
        return self.mismatch

    def _flush(self) -> bool:
        return self._flush_host() and self._flush_group()

    @staticmethod
    def _checked(a, b):
        try:
            return _native_module().comparable_pair(a, b)
        except ValueError:  # another widening, a strided view, a subclass: not for the kernel
            return None

    def _flush_host(self) -> bool:
        todo, self._host, self._host_bytes = self._host, [], 0
        if not todo or self.mismatch is not None:
            return self.mismatch is None
        for label, a, b, entry in todo:  # the addresses were taken at add(): still those of live storages?
            if a.data_ptr() != entry[0] or b.data_ptr() != entry[1] or not _holds(a) or not _holds(b):
                raise StorageReleased(label)
        first = _native_module().first_unequal_checked(self._lib, [entry for *_, entry in todo])
        if first >= 0:
            self.mismatch = todo[first][:3]
        return first < 0

    def _flush_group(self) -> bool:
        todo, self._group, self._count = self._group, [], 0
        if not todo or self.mismatch is not None:
            return self.mismatch is None
        if len(todo) > 1:
            a = torch.cat([x.reshape(-1) for _, x, _ in todo])
            b = torch.cat([y.reshape(-1) for _, _, y in todo])
            if _equal_widened(a, b):
                return True
        self.mismatch = next((item for item in todo if not _equal_widened(item[1], item[2])), None)
        return self.mismatch is None
