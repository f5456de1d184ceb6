"""Ready-made reactors (Replay, EnvActor, Learner, Evaluator, Metrics) and their client objects."""

from .messages import CheckpointRequest as CheckpointRequest
from .messages import Delete as Delete
from .messages import InsertAck as InsertAck
from .messages import MassRequest as MassRequest
from .messages import PriorityUpdate as PriorityUpdate
from .messages import SampledBatch as SampledBatch
from .messages import SampleRequest as SampleRequest
from .messages import ShardMass as ShardMass
from .messages import ShardSample as ShardSample
from .messages import ShardStatistics as ShardStatistics
from .messages import StatisticsRequest as StatisticsRequest
from .messages import Steps as Steps
from .messages import requester_key as requester_key
from .messages import shard_key as shard_key
from .messages import writer_key as writer_key
from .replay import Replay as Replay
from .replay import ReplayClient as ReplayClient
from .replay import key_local as key_local
from .replay import key_shard as key_shard
from .replay import make_keys as make_keys
from .writer import TransitionPattern as TransitionPattern
from .writer import WindowPattern as WindowPattern
from .writer import Writer as Writer
