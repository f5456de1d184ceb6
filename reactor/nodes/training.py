"""The standard training graphs: the wiring every RL app shares, written once.

``off_policy_graph`` (DQN, SAC, TD3, DDPG, the transformer agent)::

    actor[i] --steps--> replay[j] --replies--> learner[k] --weights--> actor[i], evaluator
        ^                   ^------requests/priorities----'                        |
        '---------------------------------- reports --------> metrics <------------'

``on_policy_graph`` (PPO): actors send rollouts straight to the learner; no replay.

The graph is the same under every distribution policy (``--placement single|actors|colocated|
dp-learners``); only the placement moves instances between processes. Logical delays: weights
reach actors ``weights_delay_s`` after the update that made them (actors never wait for the
learner within that window); a sample request reaches its shard half a ``step_s`` after the
sample before it arrived, its reply the learner half a step later (a cycle needs a delay), and an
update's priorities reach the shards a whole step after it. So a shard draws the next sample
before it applies the priorities of the update running meanwhile (priorities one update stale, as
in Ape-X), and in another process it draws it *while* the learner updates: the learner promises
the shards' processes, before it starts the update, that the update sends nothing sooner than a
step (``ReactorHost.promises`` reads that from the reactions' declared effects).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._graph import Graph, graph_builder
from .._runclaim import check_run_dir
from .._tag import NS_PER_S, seconds_to_ns
from ..launch._runtime import current_run_id
from ..replay.table import max_sample
from .env_actor import EnvActor, writer_pattern
from .evaluator import Evaluator
from .learner import Learner, RolloutLearner
from .messages import requester_key, shard_key, writer_key
from .metrics import Metrics
from .replay import Replay

__all__ = ["off_policy_graph", "on_policy_graph"]


@graph_builder
def off_policy_graph(
    *,
    algo: str,
    env: str,
    run_dir: str,
    algo_config: dict[str, Any] | None = None,
    actors: int = 2,
    envs_per_actor: int = 1,
    shards: int = 2,
    learners: int = 1,
    colocated: bool = False,
    capacity: int = 100_000,
    prioritized: bool = True,
    alpha: float = 0.6,
    beta: float = 0.4,
    min_size: int = 1000,
    samples_per_insert: float = 8.0,
    batch_size: int = 128,
    prefetch: int = 1,
    weights_every: int = 10,
    eval_every_updates: int = 1000,
    eval_episodes: int = 10,
    target_return: float | None = None,
    max_env_steps: int | None = None,
    seed: int = 0,
    step_s: float = 1e-6,
    weights_delay_s: float = 64e-6,
    flush_steps: int = 64,
    max_unacked: int = 8,
    checkpoint_every: int = 0,
    resume: bool = False,
    replay_checkpoint_period_s: float | None = 0.1,
    replay_async_checkpoint_period_s: float | None = 30.0,
    replay_wal: bool = False,
    replay_memory: str = "host",
    replay_remote_reads: str = "auto",
    device: str = "cpu",
    compile: str = "auto",
    live: bool = True,
    title: str = "",
    app_config: dict[str, Any] | None = None,
) -> Graph:
    """Actors, replay shards, learner(s), evaluator and metrics for an off-policy algorithm.

    The replay is a prioritized (``alpha``, ``beta``) or uniform table sharded over ``shards``
    processes, with ``capacity`` steps in all. Its rate limiter holds the learners to
    ``samples_per_insert`` sampled items per inserted step once ``min_size`` steps are stored (each
    shard lets them run at most ``batch_size`` samples ahead of that ratio): that ratio, not the speed
    of any process, fixes updates per env step (so results do not depend on the placement). Inserts the limiter holds back hold the actors back in turn: each actor stops
    stepping while ``max_unacked`` of its Steps messages are not yet acknowledged by the shards.

    Each learner keeps ``prefetch`` samples in flight (``Learner(prefetch=...)``).

    Ending: the run stops when an evaluation reaches ``target_return`` (Metrics asks for the stop),
    or when every actor has taken its share of ``max_env_steps`` and the learner has drained what
    the rate limiter allows (the run is then quiescent). Only the second is a deterministic end
    point across processes: the process that asks for a stop cannot hold back the others, which
    may be past that logical time already. Bit-identical runs use a step budget, no target.

    Replay survives: each shard checkpoints into ``run_dir/replay-<i>`` in the background every
    ``replay_checkpoint_period_s`` of logical time (an actor's env step is ``step_s``: the default
    0.1 s is every 100,000 env steps of each actor; None: only at the end), in async runs every
    ``replay_async_checkpoint_period_s`` of wall-clock time (default 30 s; None: the first, in wall
    seconds); a shard whose table did not change is not rewritten; and once more at the end of the run, and ``resume=True`` restores
    the shards from them (with the learner). Inserts since a shard's last checkpoint are lost if its
    process dies, unless ``replay_wal`` logs each one (fsynced) before acknowledging it.

    A learner samples shards of its own host from their shared memory (asynchronous runs), and
    shards of other hosts as ``replay_remote_reads`` says (``Learner(remote_reads=...)``, the
    shards' too): ``"auto"`` one-sidedly over RDMA where a device works, else through messages;
    ``"zmq"`` one-sidedly through the shards' bulk read servers; ``"off"`` through messages.

    The learner writes ``run_dir/config.json`` (algorithm, env, its resolved Config, and
    ``app_config``: the app's resolved Config, when an app built the graph) beside its weights
    (``learner.pt``): what :func:`reactor.load_policy` rebuilds the policy from.

    Raises:
        ValueError: ``algo`` is not an off-policy algorithm, ``algo_config`` does not fit its Config,
            or the env's action space is not one the algorithm acts in (naming both); checked here,
            before anything starts.
    """
    from ._registry import check_spaces, load_algorithm, make_env

    _counts("off_policy_graph", 1, actors=actors, envs_per_actor=envs_per_actor, shards=shards, learners=learners,
            capacity=capacity, batch_size=batch_size, weights_every=weights_every,
            eval_every_updates=eval_every_updates, eval_episodes=eval_episodes, flush_steps=flush_steps,
            max_unacked=max_unacked, max_env_steps=max_env_steps)
    _counts("off_policy_graph", 0, min_size=min_size, prefetch=prefetch, checkpoint_every=checkpoint_every)
    _flags("off_policy_graph", seed=seed, resume=resume, prioritized=prioritized, colocated=colocated,
           replay_wal=replay_wal, live=live)
    if isinstance(samples_per_insert, (bool, np.bool_)) or not isinstance(samples_per_insert, (int, float, np.number)) \
            or not 0 < samples_per_insert < math.inf:  # (before the limiter's error buffer is made of it)
        raise ValueError(f"off_policy_graph: samples_per_insert must be a number > 0 and finite, got "
                         f"{samples_per_insert!r:.100}")
    algo_mod = load_algorithm(algo)
    if algo_mod.KIND != "off_policy":  # (it has no store: an AttributeError from inside, was)
        raise ValueError(f"off_policy_graph needs an off-policy algorithm; {algo!r} is {algo_mod.KIND!r} "
                         f"(use on_policy_graph)")
    config = algo_mod.Config.from_dict(dict(algo_config or {}))
    probe = make_env(env)
    try:
        check_spaces(algo, algo_mod, env, probe.observation_space, probe.action_space, config)
        spec = algo_mod.store(probe.observation_space, probe.action_space, config)
    finally:
        probe.close()
    check_run_dir(run_dir, current_run_id(), resume=resume, algo=algo, env=env,
                  layout={"shards": shards, "actors": actors})
    fields = [(name, tuple(shape), str(dtype).removeprefix("torch.")) for name, shape, dtype in spec.fields]
    # A shard refuses an insert larger than itself (the message is dropped): each must hold the largest
    # an actor sends, the rows pending below flush_steps plus, from each of its envs, one episode chunk
    # (its anchors, their context, the final row) completed by the same step.
    pattern = writer_pattern(spec.read)
    segment = pattern.chunk_length + sum(pattern.context()) + 1
    largest = flush_steps - 1 + envs_per_actor * segment
    if capacity // shards < largest:
        raise ValueError(
            f"config key 'capacity' is {capacity} over {shards} shard(s): {capacity // shards} steps a shard, "
            f"below the largest insert an actor sends ({largest} rows: up to flush_steps={flush_steps} pending, "
            f"plus an episode chunk of up to {segment} rows from each of its {envs_per_actor} env(s)), which a "
            f"shard would refuse; set capacity >= {largest * shards}")
    if batch_size > max_sample(capacity // shards):  # (any split of a batch over the shards must fit in one)
        raise ValueError(
            f"config key 'batch_size' is {batch_size:,}: a shard of {capacity // shards:,} steps (capacity {capacity:,} "
            f"over {shards} shard(s)) serves at most {max_sample(capacity // shards):,} items a sample, and the run "
            f"would fail at its first update; lower batch_size (or raise capacity)")
    per_shard_min = max(1, min_size // shards)
    # The limiter's window, [min_diff, max_diff] around the ratio's balance (spi * min_size), is one-sided.
    # Above it, room for inserts: the window must admit the largest message at once, or the first insert
    # past min_size would wait forever (a fixed flush_steps + 320 rows did: 16 Pendulum envs ending together
    # sent ~3,200 rows, and the run ended with 0 updates). Below it, how far samples may run ahead of the
    # ratio: one batch a shard. A symmetric buffer sized for the largest message let the learner run that
    # far ahead too: with window=600 (a message of ~1,800 rows) it took 1,393 updates of 300 env steps where
    # ~150 were due. The width (the largest message's samples plus a batch) keeps both sides live: whenever
    # an insert must wait, a sample of up to a batch may proceed, and the reverse.
    spi = float(samples_per_insert)
    balance = spi * per_shard_min
    limiter = {"type": "SampleToInsertRatio", "samples_per_insert": spi, "min_size": per_shard_min,
               "error_buffer": [balance - batch_size, balance + spi * 2 * largest + 2 * batch_size]}
    sampler: Any = {"type": "prioritized", "alpha": alpha} if prioritized else "uniform"

    g = Graph()
    actor = g.add(
        EnvActor(algo, env, algo_config, num_envs=envs_per_actor, num_shards=shards, colocated_shard=colocated,
                 step_s=step_s, flush_steps=flush_steps, max_env_steps=_per_actor(max_env_steps, actors),
                 max_unacked=max_unacked, run_dir=run_dir, resume=resume),
        name="actor", replicas=actors,
    )
    replay = g.add(
        Replay(fields, capacity=max(1, capacity // shards), read=spec.read, sampler=sampler, rate_limiter=limiter,
               beta=beta, run_dir=run_dir, checkpoint_period_s=replay_checkpoint_period_s,
               async_checkpoint_period_s=replay_async_checkpoint_period_s,
               checkpoint_on_shutdown=True, restore=resume, wal=replay_wal, memory=replay_memory, writers=actors,
               remote_reads=replay_remote_reads),
        name="replay", replicas=shards,
    )
    learner = g.add(
        Learner(algo, env, algo_config, num_shards=shards, batch_size=batch_size, prefetch=prefetch,
                weights_every=weights_every,
                seed=seed, run_dir=run_dir, checkpoint_every=checkpoint_every, resume=resume,
                app_config=app_config, device=device, compile=compile, remote_reads=replay_remote_reads),
        name="learner", replicas=learners,
    )
    evaluator = g.add(Evaluator(algo, env, algo_config, every_updates=eval_every_updates, episodes=eval_episodes),
                      name="evaluator")
    metrics = g.add(Metrics(run_dir, target_return=target_return, env_step_budget=max_env_steps, live=live,
                            title=title, resume=resume), name="metrics")
    g.connect(actor.steps, replay.steps, key=shard_key, delay_s=step_s)
    # Writers' flow control. The delay is the actors' lookahead on the shards' processes (as
    # weights_delay_s is on the learner's): a shorter one would make them wait for a promise each step.
    g.connect(replay.acks, actor.acks, key=writer_key, delay_s=weights_delay_s)
    # Sampling overlaps the learner's update across processes (module docstring): the priorities'
    # delay must exceed the requests'. Data-parallel learners update in rounds, once every replica's
    # sample is in (Learner.heard), and keep the plain cycle: requests and priorities at once, replies a step later.
    overlap = learners == 1
    step_ns = seconds_to_ns(step_s, "step_s")
    if overlap and step_ns < 2:
        raise ValueError(f"step_s must be at least 2 ns (requests and replies take half a step each), got {step_s!r}")
    req_ns = step_ns // 2 if overlap else 0
    g.connect(learner.requests, replay.requests, key=shard_key, delay_s=req_ns / NS_PER_S)
    g.connect(learner.priorities, replay.updates, key=shard_key, delay_s=step_s if overlap else 0.0)
    g.connect(replay.replies, learner.replies, key=requester_key, delay_s=(step_ns - req_ns) / NS_PER_S)
    if learners > 1:  # data-parallel rounds: every replica hears every replica's word (Learner.heard) a step later
        g.connect(learner.ready, learner.bank, delay_s=step_s)
    g.connect(learner.weights, actor.weights, delay_s=weights_delay_s)
    g.connect(learner.weights, evaluator.weights)
    for src in (actor.report, learner.report, evaluator.report):
        g.connect(src, metrics.reports, delay_s=step_s)
    return g


def _counts(builder: str, low: int, **named: Any) -> None:
    """Raise ``ValueError`` naming the first of ``named`` that is not an int >= ``low`` (None passes: an
    optional budget). The apps' configs check theirs by key (``reactor/nodes/apps.py``); a script calling
    a builder got a ZeroDivisionError for ``actors=0`` with a budget, and ran ``max_env_steps=-5``."""
    for name, v in named.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ValueError(f"{builder}: {name} must be an int >= {low}{' or None' if name == 'max_env_steps' else ''}"
                             f", got {v!r:.100}")


def _flags(builder: str, *, seed: int, **flags: Any) -> None:
    """Raise ``ValueError`` naming a flag that is not a bool (``resume="False"`` resumed), or a seed that is
    not an int: from Python, with no Config to type them as the apps' ``--set`` does."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{builder}: seed must be an int, got {seed!r:.100}")
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{builder}: {name} must be True or False, got {v!r:.100}")


def _per_actor(max_env_steps: int | None, actors: int) -> int | None:
    return None if max_env_steps is None else -(-max_env_steps // actors)


@graph_builder
def on_policy_graph(
    *,
    algo: str,
    env: str,
    run_dir: str,
    algo_config: dict[str, Any] | None = None,
    actors: int = 2,
    envs_per_actor: int = 4,
    eval_every_updates: int = 5,
    eval_episodes: int = 10,
    target_return: float | None = None,
    max_env_steps: int | None = None,
    seed: int = 0,
    step_s: float = 1e-6,
    weights_delay_s: float = 64e-6,
    checkpoint_every: int = 0,
    resume: bool = False,
    device: str = "cpu",
    compile: str = "auto",
    live: bool = True,
    title: str = "",
    app_config: dict[str, Any] | None = None,
) -> Graph:
    """Actors send rollouts straight to one learner (synchronous on-policy training, e.g. PPO).

    The actors wait for the weights that learned from their rollout, so ``weights_delay_s`` changes
    no result; it is the logical lookahead an actor in another process gets: with it longer than a
    rollout (``rollout_length * step_s``), an actor steps a whole rollout on one promise from the
    learner's process instead of waiting for one every step.

    Raises:
        ValueError: ``algo`` is not an on-policy algorithm, or ``algo_config`` does not fit its
            Config, or its ``rollout_length`` is not an int >= 1 (checked here, before anything starts).
    """
    from ._contract import check_config
    from ._registry import check_spaces, load_algorithm, make_env

    _counts("on_policy_graph", 1, actors=actors, envs_per_actor=envs_per_actor, eval_every_updates=eval_every_updates,
            eval_episodes=eval_episodes, max_env_steps=max_env_steps)
    _counts("on_policy_graph", 0, checkpoint_every=checkpoint_every)
    _flags("on_policy_graph", seed=seed, resume=resume, live=live)
    algo_mod = load_algorithm(algo)
    if algo_mod.KIND != "on_policy":
        raise ValueError(f"on_policy_graph needs an on-policy algorithm; {algo!r} is {algo_mod.KIND!r} "
                         f"(use off_policy_graph)")
    config = algo_mod.Config.from_dict(dict(algo_config or {}))
    check_config(algo_mod, config)
    probe = make_env(env)
    try:
        check_spaces(algo, algo_mod, env, probe.observation_space, probe.action_space, config)
    finally:
        probe.close()
    check_run_dir(run_dir, current_run_id(), resume=resume, algo=algo, env=env, layout={"actors": actors})
    g = Graph()
    actor = g.add(EnvActor(algo, env, algo_config, num_envs=envs_per_actor, step_s=step_s,
                           max_env_steps=_per_actor(max_env_steps, actors), run_dir=run_dir, resume=resume),
                  name="actor", replicas=actors)
    learner = g.add(RolloutLearner(algo, env, algo_config, num_actors=actors, seed=seed, run_dir=run_dir,
                                   checkpoint_every=checkpoint_every, resume=resume, app_config=app_config,
                                   device=device, compile=compile),
                    name="learner")
    evaluator = g.add(Evaluator(algo, env, algo_config, every_updates=eval_every_updates, episodes=eval_episodes),
                      name="evaluator")
    metrics = g.add(Metrics(run_dir, target_return=target_return, env_step_budget=max_env_steps, live=live,
                            title=title, resume=resume, budget_end="the learner learned on their last rollouts"),
                    name="metrics")
    g.connect(actor.rollouts, learner.rollouts)
    g.connect(learner.weights, actor.weights, delay_s=weights_delay_s)
    g.connect(learner.weights, evaluator.weights)
    for src in (actor.report, learner.report, evaluator.report):
        g.connect(src, metrics.reports, delay_s=step_s)
    return g
