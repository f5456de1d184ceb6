"""The off-policy Learner samples one-sidedly once its shards offer it (issue 21): after the first batch
(through messages, which brings the offer), every batch is drawn from the shards' shared memory in the
learner's own loop, learned on, and counted at the shards; the run ends at ``max_updates``. Windows
(transformer_dqn) and n-step transitions (dqn), under a MinSize limiter and under the training
graphs' SampleToInsertRatio, whose count the learner takes its draws from."""

from __future__ import annotations

import numpy as np
import pytest

from reactor import Graph, Input, Output, Reactor, graph_builder, reaction, run, startup
from reactor.nodes import Replay, StatisticsRequest, Steps, requester_key, shard_key
from reactor.nodes.learner import Learner
from reactor.nodes.messages import ReplayControl, ShardStatistics
from reactor.nodes.train_messages import Report, Weights

FIELDS = [("obs", (4,), "float32"), ("action", (), "int64"), ("reward", (), "float32"), ("terminated", (), "bool")]


class Filler(Reactor):
    placement_role = "actor"
    steps = Output(Steps)

    @reaction(triggers=[startup], effects=[steps])
    def fill(self) -> None:
        rng = np.random.default_rng(0)
        n = 600  # 30 episodes of 20 steps
        ends = np.zeros(n, bool)
        ends[19::20] = True
        self.steps.send(Steps(0, -1, 0, {"obs": rng.normal(size=(n, 4)).astype(np.float32),
                                         "action": rng.integers(0, 2, n), "reward": np.ones(n, np.float32),
                                         "terminated": ends.copy()}, ends, None, np.ones(n)))


class Sink(Reactor):
    weights = Input(Weights)
    report = Input(Report)
    statistics = Input(ShardStatistics)
    control = Output(ReplayControl)

    def __init__(self, out: list) -> None:
        self.out = out

    @reaction(triggers=[weights])
    def got_weights(self, weights: Weights) -> None:
        pass

    @reaction(triggers=[report], effects=[control])
    def got_report(self, report: Report) -> None:
        self.out.append(dict(report.values))
        if report.values["updates"] >= 40:
            self.control.send(StatisticsRequest())

    @reaction(triggers=[statistics])
    def got_statistics(self, statistics: ShardStatistics) -> None:
        self.out.append({"sampled": statistics.sampled})


_OUT: list = []


_RATIO = {"type": "SampleToInsertRatio", "samples_per_insert": 1.25, "min_size": 100, "error_buffer": [-1e9, 1e9]}


@graph_builder
def _graph(algo: str = "transformer_dqn", limiter: dict | None = None) -> Graph:
    g = Graph()
    filler = g.add(Filler(), name="filler")
    read = ({"type": "WindowRead", "length": 5, "pad": "tail"} if algo == "transformer_dqn" else
            {"type": "TransitionRead", "n": 3, "gamma": 0.99, "next_fields": ["obs", "terminated"]})
    replay = g.add(Replay(FIELDS, capacity=2048, read=read, sampler={"type": "prioritized", "alpha": 0.6},
                          rate_limiter=limiter or {"type": "MinSize", "min_size": 100},
                          bulk=True if algo == "dqn" else None), name="replay")
    learner = g.add(Learner(algo, "CartPole-v1", {"window": 4} if algo == "transformer_dqn" else {"n_step": 3},
                            batch_size=16, max_updates=40, report_every=10), name="learner")
    sink = g.add(Sink(_OUT), name="sink")
    g.connect(filler.steps, replay.steps, key=shard_key)
    g.connect(learner.requests, replay.requests, key=shard_key)
    g.connect(replay.replies, learner.replies, key=requester_key, delay_s=0.001)
    g.connect(learner.priorities, replay.updates, key=shard_key)
    g.connect(learner.weights, sink.weights)
    g.connect(learner.report, sink.report)
    g.connect(sink.control, replay.control)
    g.connect(replay.statistics, sink.statistics, delay_s=0.001)
    return g


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo,limiter", [("transformer_dqn", None), ("transformer_dqn", _RATIO), ("dqn", _RATIO)],
                         ids=["windows-minsize", "windows-ratio", "transitions-ratio"])
def test_the_learner_draws_its_batches_one_sidedly_once_offered(algo, limiter):
    """With SampleToInsertRatio(1.25) over 600 steps the limiter allows 750 samples: the 40 batches
    of 16 (640) come one-sidedly (the ratio's count is the budget the learner takes from)."""
    _OUT.clear()
    run(_graph(algo, limiter), deterministic=False)
    reports = [r for r in _OUT if "updates" in r]
    assert reports and reports[-1]["updates"] == 40
    assert reports[-1]["one_sided_batches"] >= 38  # all but the first (and one in flight at the switch)
    # Some drawn on the client's thread while the learner updated on the batch before. How many is the
    # scheduler's: on a loaded machine a draw thread is not always run before the learner asks for its
    # batch, which the learner then draws itself (none done, one not started: next_drawn), and those
    # are not counted (26 of 39 with the two files' tests on 2 workers, 11 of 39 in a full CI run;
    # 36-39 alone). What share a learner gets is bench_onesided's and the service benchmark's business.
    assert reports[-1]["drawn_ahead_batches"] >= 1, reports[-1]
    sampled = [r["sampled"] for r in _OUT if "sampled" in r]
    assert sampled and sampled[-1] >= 39 * 16  # the shard counted the one-sided draws from the notices


@pytest.mark.timeout(120)
def test_deterministic_learners_keep_the_message_path():
    _OUT.clear()
    run(_graph(), deterministic=True)
    reports = [r for r in _OUT if "updates" in r]
    assert reports[-1]["updates"] == 40 and reports[-1]["one_sided_batches"] == 0
    assert reports[-1]["drawn_ahead_batches"] == 0


@pytest.mark.timeout(120)
def test_a_declined_draw_ahead_hands_the_draws_queued_behind_it_to_the_learner(monkeypatch):
    """One draw ahead declines (as when a shard changes for longer than the draw waits, or a limiter
    refuses): the learner takes every draw queued behind it at once (drain_drawn) and learns on their
    batches, none lost and none learned twice: 40 updates, the batches after the first still drawn
    one-sidedly, and the shard counts every item of them. (Mutation-checked: without the drain the
    learner went back to messages for its prefetch and drew 36 one-sidedly.)"""
    from reactor.nodes._onesided import OneSidedSampling

    real = OneSidedSampling.sample_now
    calls = []

    def sometimes_declines(self, n):
        calls.append(n)
        if len(calls) == 12:  # queued behind it: the draws the learner keeps running ahead
            return None, self.take_notices()
        return real(self, n)

    monkeypatch.setattr(OneSidedSampling, "sample_now", sometimes_declines)
    _OUT.clear()
    run(_graph(), deterministic=False)
    reports = [r for r in _OUT if "updates" in r]
    assert reports[-1]["updates"] == 40
    assert len(calls) >= 13  # the decline happened, with draws after it
    one_sided = reports[-1]["one_sided_batches"]
    # All but the first (and one message batch in flight at the switch), the declined one replaced by
    # those queued behind it: had the learner gone back to messages, `prefetch` more would be missing.
    assert one_sided >= 38, reports[-1]
    sampled = [r["sampled"] for r in _OUT if "sampled" in r]
    # every batch counted at the shard, once (the last batch's notices may still be on their way)
    assert sampled and 39 * 16 <= sampled[-1] <= 40 * 16


@pytest.mark.timeout(120)
def test_a_shard_whose_one_sided_offer_proves_malformed_is_sampled_through_messages_for_the_rest_of_its_life(
        monkeypatch, caplog):
    """The 12th one-sided draw raises MalformedFrameError naming shard 0 (as sample_now does for a
    published state that refuses every draw under a settled count: tests/nodes/test_replay_onesided.py),
    and the learner samples that shard through messages from then on (ReplayClient.drop_one_sided), to
    its 40 updates: no draw after the draws already ahead. Before, the offer stayed: the learner went
    back to one-sided draws at once, and on a corrupt state every other batch was a failed draw and a
    warning, to the run's end (a hostile review). (Mutation-checked: without the drop, 40 draws in all.)"""
    import logging

    from reactor._errors import MalformedFrameError
    from reactor.nodes._onesided import OneSidedSampling

    real = OneSidedSampling.sample_now
    calls = []

    def malformed_once(self, n):
        calls.append(n)
        if len(calls) == 12:
            bad = MalformedFrameError("replay shard 0: its published sampling state is inconsistent (the test's)")
            bad.shard = 0
            bad.notices = self.take_notices()
            raise bad
        return real(self, n)

    monkeypatch.setattr(OneSidedSampling, "sample_now", malformed_once)
    _OUT.clear()
    with caplog.at_level(logging.WARNING):
        run(_graph(), deterministic=False)
    reports = [r for r in _OUT if "updates" in r]
    assert reports[-1]["updates"] == 40
    assert 12 <= len(calls) <= 14, len(calls)  # (the draws already ahead of the 12th, prefetch 1: at most 2)
    assert reports[-1]["one_sided_batches"] <= 13, reports[-1]
    assert sum("is sampled through messages from now on" in r.getMessage() for r in caplog.records) == 1
    sampled = [r["sampled"] for r in _OUT if "sampled" in r]
    assert sampled and 39 * 16 <= sampled[-1] <= 40 * 16  # every batch counted at the shard, once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["drawn", "gathered"])
def test_a_batch_whose_every_item_was_dropped_is_not_learned_on_and_is_counted_as_empty(monkeypatch, path):
    """One batch has every window dropped as overwritten while it was read (forced: the row horizon's
    check of the 12th one-sided draw, or the version check of the first batch's gather through messages,
    says so for each), so it holds no item. The learner does not hand it to the algorithm's learn: each of
    its 40 updates learns on 16 items, ``samples`` counts 640 and ``empty_batches`` 1; the draws of the
    empty batch still reach the shard (its times sampled: the shard counts them). Before, learn ran on 0
    items as an update (``updates`` 40 with 39 batches of items, its loss NaN)."""
    from reactor.nodes._device import LearnStep
    from reactor.nodes._onesided import OneSidedSampling
    from reactor.nodes.replay_client import ReplayClient

    calls, learned = [], []
    if path == "drawn":
        real_finish = OneSidedSampling._finish_one_sided

        def finish(self, n, drawn, table_size, plan, out, mask, keys, probs, weights, times, valid, hurry=False):
            calls.append(n)
            if len(calls) == 12:
                valid[:] = False  # every window's rows overwritten during the copy
            return real_finish(self, n, drawn, table_size, plan, out, mask, keys, probs, weights, times, valid, hurry)

        monkeypatch.setattr(OneSidedSampling, "_finish_one_sided", finish)
    else:
        real_gather = ReplayClient._gather

        async def gather(self, parts):
            data, keep = await real_gather(self, parts)
            calls.append(len(parts))
            if len(calls) == 1:
                keep = np.zeros(sum(len(p.keys) for p in parts), bool)  # every item's rows overwritten
            return data, keep

        monkeypatch.setattr(ReplayClient, "_gather", gather)
    real_learn = LearnStep.__call__

    def learn(self, state, batch):
        learned.append(len(batch["weights"]))
        return real_learn(self, state, batch)

    monkeypatch.setattr(LearnStep, "__call__", learn)
    _OUT.clear()
    run(_graph(), deterministic=False)
    reports = [r for r in _OUT if "updates" in r]
    assert len(calls) >= (12 if path == "drawn" else 1)
    assert learned == [16] * 40, learned
    assert reports[-1]["updates"] == 40 and reports[-1]["samples"] == 640 and reports[-1]["empty_batches"] == 1
    assert all(np.isfinite(v) for v in reports[-1].values()), reports[-1]
    sampled = [r["sampled"] for r in _OUT if "sampled" in r]
    assert sampled and 40 * 16 <= sampled[-1] <= 41 * 16  # the empty batch's draws counted too (the last's may be on their way)


@pytest.mark.timeout(120)
def test_a_learner_whose_batches_keep_coming_empty_says_so_again_at_the_10th(monkeypatch, caplog):
    """Ten one-sided draws in a row have every window dropped as overwritten (forced, as above), then the
    draws are whole again. The learner says it at the first empty batch and again at the 10th (then the
    100th, ...), with the updates made. Before, it said it once: reports go with updates, so a learner
    whose every batch came empty sampled on with no update and no word after the first (a review of the
    empty-batch change, session 70)."""
    import logging

    from reactor.nodes._onesided import OneSidedSampling

    real_finish = OneSidedSampling._finish_one_sided
    calls = []

    def finish(self, n, drawn, table_size, plan, out, mask, keys, probs, weights, times, valid, hurry=False):
        calls.append(n)
        if 2 <= len(calls) <= 11:
            valid[:] = False  # every window's rows overwritten during the copy
        return real_finish(self, n, drawn, table_size, plan, out, mask, keys, probs, weights, times, valid, hurry)

    monkeypatch.setattr(OneSidedSampling, "_finish_one_sided", finish)
    _OUT.clear()
    with caplog.at_level(logging.WARNING, logger="reactor.learner"):
        run(_graph(), deterministic=False)
    reports = [r for r in _OUT if "updates" in r]
    assert reports[-1]["updates"] == 40 and reports[-1]["empty_batches"] == 10, reports[-1]
    said = [r.getMessage() for r in caplog.records if "held no item" in r.getMessage()]
    assert [m.split(" held no item")[0] for m in said] == ["learner: a sampled batch", "learner: 10 sampled batches"]
    assert all(m.endswith(")") and "empty_batches; updates so far: " in m for m in said), said
