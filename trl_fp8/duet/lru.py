"""A bounded least-recently-used table with an undo journal: DUET's per-prompt tables (the surrogate's statistics, the
pass rates) as they were at a mark, at a cost proportional to what changed since.

Why: a capability that a stop can cut mid-step has its ``state_dict()`` copied at every step boundary
(:mod:`trl_fp8.checkpoints.boundary`); for DUET that was its whole per-prompt tables — 100k prompts, about half a
second a step — although a step changes only its batch's prompts. :meth:`LruTable.mark` opens a journal in O(1); the
first change of a key after it records the key's entry as it was (a copy) and its place in the order; evictions and
insertions are changes too. :meth:`LruTable.items_at_mark` rebuilds the table as it was at the mark (one pass over
it, the changed keys merged back in; paid only when a stop actually saves). The order is kept as stamps (a counter, increasing with recency), so
a key's old place is a number in the journal.

Pure Python, no TRL.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from operator import itemgetter

_ABSENT = None  # what the journal records for a key that was not in the table at the mark
_first = itemgetter(0)


class LruTable:
    """``key -> entry``, least recently used first, at most ``capacity`` entries (the oldest evicted).

    Reading: ``table[key]``, ``get``, ``in``, ``len``, iteration and ``items()`` in LRU order. Changing: only through
    :meth:`put` (insert or replace, most recent), :meth:`touch` (make most recent) and :meth:`changing` (call it
    before mutating an entry in place); ``copy_entry`` copies an entry for the journal."""

    def __init__(self, capacity: int, copy_entry: Callable):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._copy = copy_entry
        self._data: OrderedDict = OrderedDict()
        self._stamp: dict = {}
        self._clock = 0
        self._journal: dict | None = None  # key -> (entry copy, stamp) or _ABSENT; None: no mark open
        self._mark = 0  # which mark the journal belongs to

    # -- reading ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def get(self, key, default=None):
        return self._data.get(key, default)

    def items(self):
        return self._data.items()

    # -- changing ---------------------------------------------------------------------------------------------
    def changing(self, key) -> None:
        """Record ``key`` as it is now, once per mark (before its first change since the mark)."""
        journal = self._journal
        if journal is not None and key not in journal:
            journal[key] = (self._copy(self._data[key]), self._stamp[key]) if key in self._data else _ABSENT

    def _newest(self, key) -> None:
        self._clock += 1
        self._stamp[key] = self._clock

    def touch(self, key) -> None:
        """Make ``key`` (present) the most recently used."""
        self.changing(key)
        self._data.move_to_end(key)
        self._newest(key)

    def put(self, key, entry) -> None:
        """Insert or replace ``key`` as the most recently used; evict the oldest beyond the capacity."""
        self.changing(key)
        self._data[key] = entry
        self._data.move_to_end(key)
        self._newest(key)
        while len(self._data) > self.capacity:
            oldest = next(iter(self._data))
            self.changing(oldest)
            del self._data[oldest]
            del self._stamp[oldest]

    def load(self, items) -> None:
        """Replace everything with ``(key, entry)`` pairs, least recently used first. Closes any open mark."""
        self._data = OrderedDict(items)
        self._stamp = {}
        self._clock = 0
        for key in self._data:
            self._newest(key)
        self._journal = None
        self._mark += 1

    # -- marks ------------------------------------------------------------------------------------------------
    def mark(self) -> int:
        """Open a new journal (O(1)): :meth:`items_at_mark` can then rebuild the table as it is now. Returns the
        mark's id."""
        self._journal = {}
        self._mark += 1
        return self._mark

    def items_at_mark(self, mark: int) -> list:
        """``[(key, entry), ...]`` as they were at ``mark`` (the latest), least recently used first. Entries of keys
        unchanged since are the live ones: read them before the table changes again."""
        if self._journal is None or mark != self._mark:
            raise RuntimeError("this mark is no longer the table's latest: its state cannot be rebuilt")
        journal, stamps = self._journal, self._stamp
        # the unchanged keys are in stamp order already (the table's order); the journaled ones are merged in
        unchanged = ((stamps[key], key, entry) for key, entry in self._data.items() if key not in journal)
        before = sorted(((stamp, key, entry) for key, old in journal.items() if old is not _ABSENT
                         for entry, stamp in (old,)), key=_first)
        return [(key, entry) for _, key, entry in heapq.merge(unchanged, before, key=_first)]
