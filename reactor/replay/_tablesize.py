"""How much memory a :class:`~reactor.replay.Table` takes: the host memory it needs once full, which
it claims before it allocates (:func:`claim_fits`, counted in :mod:`reactor.replay._hostmem`'s ledgers),
how much of that it holds so far, the bytes a sampled item takes, and the largest sample it takes."""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._hostmem import MemoryClaim, claim_host_memory
from .reads import TransitionRead, WindowRead
from .storage import Storage

if TYPE_CHECKING:
    from .table import Table


#: ``sample_nowait(n)`` refuses ``n`` above ``max(_SAMPLE_PER_SLOT * capacity, _MIN_SAMPLE_LIMIT)``.
_SAMPLE_PER_SLOT = 64
_MIN_SAMPLE_LIMIT = 1 << 16


def _item_nbytes(storage: Storage, read: Any) -> int:
    """Bytes one sampled item takes in a batch (a lower bound for episodes), plus its info."""
    row = {s.name: int(math.prod(s.shape)) * s.dtype.itemsize for s in storage.specs}
    total = sum(row.values())
    if isinstance(read, WindowRead):
        total = total * read.length + read.length
    elif isinstance(read, TransitionRead):
        # (and, while it is read, each item's n steps of the return: their rows' indices and rewards)
        total += sum(row[f] for f in read.next_fields) + 9 + read.n * (16 + row[read.reward_field])
    return total + 28  # key, probability, weight, times sampled


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 46


_PHYSICAL_MEMORY = _physical_memory()


#: Host bytes a table keeps per slot of capacity beside the rows: its sampling state (sum and min trees,
#: the dense slot lists), keys, sample counts and the storage's episode index. Measured: 100 B a slot in all
#: for a 4M-step table of 24-byte steps (Prioritized and Uniform alike), of which 76 beside the rows.
_SLOT_NBYTES = 80


def table_host_nbytes(step_nbytes: int, capacity: int, on_host: bool = True) -> int:
    """The host memory a table of ``capacity`` steps of ``step_nbytes`` needs once full: its rows (where
    they are host memory: ``on_host``) and ~``_SLOT_NBYTES`` a slot of sampling state."""
    return capacity * ((step_nbytes if on_host else 0) + _SLOT_NBYTES)


def _filled_host_nbytes(table: weakref.ref[Table]) -> Callable[[], int]:
    """How much of its claim a table holds now: its sampling state (written when made) and the rows
    written so far (a ring's pages come as it fills, and stay)."""

    def filled() -> int:
        t = table()
        if t is None:
            return 0
        st = t._storage
        rows = st.step_nbytes if st.device.type == "cpu" else 0
        return min(st.step_range[1], st.capacity) * rows + st.capacity * _SLOT_NBYTES

    return filled


def claim_fits(storage: Storage | None, capacity: int, *, ledger: str | None = None, step_nbytes: int | None = None,
               on_host: bool = True) -> MemoryClaim:
    """Claim the host memory a table needs once full, or refuse a table that cannot fit, before its
    sampling state is allocated (the trees are written at once): a capacity with a zero too many was
    ended by the OOM killer after ~20 GB, without a word. The rows count too, though they are only
    touched as they fill: otherwise the end would come hours later. A GPU storage's rows are not host
    memory. The claim is counted with the other live tables of ``ledger`` (None: this process's; a run
    id: that run's on this host, :mod:`reactor.replay._hostmem`): the shards of a run on one host each
    fitted alone, and together did not.

    Args:
        storage: the table's storage (its row size and device), or None with ``step_nbytes`` and ``on_host``
            (a storage about to be made).

    Raises:
        ValueError: it does not fit (naming the need and what the host has).
    """
    if storage is not None:
        step_nbytes, on_host = storage.step_nbytes, storage.device.type == "cpu"
    assert step_nbytes is not None
    rows = step_nbytes if on_host else 0
    need = table_host_nbytes(step_nbytes, capacity, on_host)
    what = (f"a replay table of capacity {capacity:,} steps needs about {need / 2**30:.1f} GiB once full ({rows} B a "
            f"step of rows and ~{_SLOT_NBYTES} B a slot of sampling state)")
    return claim_host_memory(need, what, ledger=ledger)


def max_sample(capacity: int) -> int:
    """The most items one sample of a table of ``capacity`` slots may ask for (beyond it a request is a
    bug, not a batch: it would surface as a MemoryError from the output's allocation)."""
    return max(_SAMPLE_PER_SLOT * capacity, _MIN_SAMPLE_LIMIT)
