"""Replay engine: storage, selectors, rate limiters and tables. Usable without the runtime.

Layer map (imports point down):  table -> {reads, _tablekernels, _tablesize -> _hostmem, _tablestate -> checkpoint,
storage -> {_storagekernels, _storagestate -> _storagekernels}, selectors -> sumtree, rate_limiters};
wal (the insert log a shard keeps beside its checkpoints) stands apart.
``from reactor.replay import Table`` needs nothing of the reactor runtime.
"""

from .checkpoint import CheckpointCorruptError as CheckpointCorruptError
from .rate_limiters import MinSize as MinSize
from .rate_limiters import Queue as Queue
from .rate_limiters import RateLimiter as RateLimiter
from .rate_limiters import RateLimiterStatistics as RateLimiterStatistics
from .rate_limiters import SampleToInsertRatio as SampleToInsertRatio
from .rate_limiters import Stack as Stack
from .reads import EpisodeRead as EpisodeRead
from .reads import StepRead as StepRead
from .reads import TransitionRead as TransitionRead
from .reads import WindowRead as WindowRead
from .selectors import Fifo as Fifo
from .selectors import Lifo as Lifo
from .selectors import MaxHeap as MaxHeap
from .selectors import MinHeap as MinHeap
from .selectors import Prioritized as Prioritized
from .selectors import Selector as Selector
from .selectors import Uniform as Uniform
from .storage import AppendResult as AppendResult
from .storage import FieldSpec as FieldSpec
from .storage import Storage as Storage
from .storage import StorageMemory as StorageMemory
from .storage import TransitionPlan as TransitionPlan
from .storage import expand_window_spans as expand_window_spans
from .sumtree import SumTree as SumTree
from .table import SampleInfo as SampleInfo
from .table import Table as Table
from .table import TableStatistics as TableStatistics
from .wal import WriteAheadLog as WriteAheadLog
from .wal import read_wal as read_wal
from .wal import redo_wal as redo_wal
