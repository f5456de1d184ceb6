"""Distribution policies map any graph's instances to processes by placement_role."""

from __future__ import annotations

import pytest

from reactor import Graph, GraphError, Input, Output, Reactor, reaction
from reactor.launch._placement import resolve


class Actor(Reactor):
    placement_role = "actor"
    out = Output(int)


class Shard(Reactor):
    placement_role = "replay"
    inp = Input(int)
    out = Output(int)

    @reaction(triggers=[inp], effects=[out])
    def serve(self, inp: int) -> None:
        self.out.send(inp)


class Learner(Reactor):
    placement_role = "learner"
    replicas_apart = "data-parallel"
    inp = Input(int)


class Metrics(Reactor):
    inp = Input(int)


def _graph(actors: int, shards: int, learners: int = 1) -> Graph:
    g = Graph()
    a = g.add(Actor(), name="actor", replicas=actors)
    s = g.add(Shard(), name="replay", replicas=shards)
    learner = g.add(Learner(), name="learner", replicas=learners)
    m = g.add(Metrics(), name="metrics")
    g.connect(a.out, s.inp, mode="round_robin")
    g.connect(s.out, learner.inp)
    g.connect(a.out, m.inp)
    return g


def _groups(graph: Graph, policy: str) -> dict[str, tuple[str, ...]]:
    return {g.name: g.reactors for g in resolve(graph, policy)}


def test_actors_policy_gives_each_actor_and_shard_a_process_and_keeps_the_rest_with_the_learner():
    assert _groups(_graph(3, 2), "actors") == {
        "learner": ("learner", "metrics"),
        "actor-0": ("actor[0]",), "actor-1": ("actor[1]",), "actor-2": ("actor[2]",),
        "replay-0": ("replay[0]",), "replay-1": ("replay[1]",),
    }


def test_colocated_policy_pairs_actor_i_with_shard_i_and_leftovers_stand_alone():
    assert _groups(_graph(3, 2), "colocated") == {
        "learner": ("learner", "metrics"),
        "actor-0": ("actor[0]", "replay[0]"), "actor-1": ("actor[1]", "replay[1]"), "actor-2": ("actor[2]",),
    }
    assert _groups(_graph(1, 2), "colocated")["replay-1"] == ("replay[1]",)


def test_dp_learners_policy_gives_every_learner_replica_its_own_process():
    groups = _groups(_graph(2, 2, learners=3), "dp-learners")
    assert groups["learner-0"] == ("learner[0]",) and groups["learner-2"] == ("learner[2]",)
    assert groups["driver"] == ("metrics",)
    assert sum(len(v) for v in groups.values()) == 2 + 2 + 3 + 1


def test_an_unknown_placement_names_the_policies():
    with pytest.raises(GraphError, match=r"unknown placement 'actorz'.*actors, colocated, dp-learners"):
        resolve(_graph(1, 1), "actorz")


@pytest.mark.parametrize("policy,process", [("actors", "learner"), ("colocated", "learner"), ("file", "head")])
def test_replicas_that_each_need_a_process_are_refused_in_one_with_the_placement_to_use(policy, process, tmp_path):
    """Regression (a newcomer's run, session 52): ``--set learners=2`` without ``dp-learners`` put both
    data-parallel replicas in one process, whose first replica then waited 600 s in its rendezvous for
    the second (which that process could never start), deaf to Ctrl-C. Now it is refused up front."""
    if policy == "file":
        policy = str(tmp_path / "p.toml")
        (tmp_path / "p.toml").write_text('[groups.head]\nreactors = ["learner*", "metrics"]\n'
                                         '[groups.rest]\nreactors = ["actor*", "replay*"]\n')
    with pytest.raises(GraphError, match=rf"^learner: its 2 replicas each need a process of their own \(data-parallel\), "
                                         rf"but placement '.*' puts learner\[0\] and learner\[1\] in process "
                                         rf"'{process}': use --placement dp-learners \(in Python, run\(graph, placement='dp-learners'\)\), "
                                         rf"or a placement file with each "
                                         rf"replica in a group of its own \(.*test_policies.py:\d+\)$"):
        resolve(_graph(2, 2, learners=2), policy)
    assert resolve(_graph(2, 2, learners=1), policy)  # (one replica: nothing to keep apart)
    assert resolve(_graph(2, 2, learners=2), "dp-learners")


def test_replicas_that_each_need_a_process_are_refused_in_a_single_process_run():
    from reactor import run

    with pytest.raises(GraphError, match=r"^learner: its 2 replicas .* placement 'single' puts learner\[0\] and "
                                         r"learner\[1\] in process 'main'") as got:
        run(_graph(1, 1, learners=2))
    # (Not shown "during handling of" RuntimeError('no running event loop'): a newcomer's pass, session 52.)
    assert got.value.__context__ is None, repr(got.value.__context__)


def test_a_placement_file_names_an_instance_by_its_own_name_brackets_and_all(tmp_path):
    """Regression (session 52): ``reactors = ["actor[1]"]`` matched no reactor: as an fnmatch pattern,
    "[1]" is a character class ("actor1"). An instance's own name now matches itself; patterns stay."""
    path = tmp_path / "p.toml"
    path.write_text('[groups.one]\nreactors = ["actor[1]", "replay[0]"]\n'
                    '[groups.rest]\nreactors = ["actor[0]", "replay[1]", "learn*", "metrics"]\n')
    groups = _groups(_graph(2, 2), str(path))
    assert groups == {"one": ("actor[1]", "replay[0]"), "rest": ("actor[0]", "replay[1]", "learner", "metrics")}
