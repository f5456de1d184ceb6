"""Storage: columnar ring of steps, whole-episode eviction, vectorized reads (issue 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reactor.replay.storage import FieldSpec, Storage, expand_window_spans

SPECS = [
    FieldSpec("obs", (3,), torch.float32),
    FieldSpec("action", (), torch.int64),
    FieldSpec("reward", (), torch.float32),
    FieldSpec("flag", (), torch.bool),
]


def steps(start: int, n: int) -> dict[str, torch.Tensor]:
    """n steps whose values encode their insertion number (start, start+1, ...)."""
    v = torch.arange(start, start + n)
    return {
        "obs": v.float()[:, None].repeat(1, 3) + torch.tensor([0.0, 0.25, 0.5]),
        "action": v.long(),
        "reward": v.float(),
        "flag": (v % 2 == 0),
    }


def snapshot(s: Storage) -> dict:
    st_ = s.state_dict()
    return {
        "fields": {k: v.clone() for k, v in st_["fields"].items()},
        **{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in st_.items() if k != "fields"},
    }


def same(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    for k in a:
        if k == "fields":
            if any(not torch.equal(a[k][f], b[k][f]) for f in a[k]):
                return False
        elif a[k] != b[k]:
            return False
    return True


def test_append_assigns_contiguous_global_steps_and_reads_them_back():
    s = Storage(SPECS, 16)
    assert s.append(steps(0, 5)).first_step == 0
    assert s.append(steps(5, 3)).first_step == 5
    out = s.read_steps(np.array([0, 7, 3]))
    assert out["action"].tolist() == [0, 7, 3]
    assert out["obs"][1].tolist() == [7.0, 7.25, 7.5]
    assert out["flag"].tolist() == [True, False, False]
    assert s.num_steps == 8 and s.num_episodes == 2


def test_variable_length_episodes_take_exactly_their_steps():
    s = Storage(SPECS, 100)
    s.append(steps(0, 3))
    s.append(steps(3, 40))
    s.append(steps(43, 1))
    assert s.num_steps == 44
    ep = s.read_episodes(np.array([0, 1, 2]))
    assert ep["lengths"].tolist() == [3, 40, 1]
    assert ep["action"].tolist() == list(range(44))


def test_ring_evicts_whole_oldest_episodes_only():
    s = Storage(SPECS, 10)
    s.append(steps(0, 4))
    s.append(steps(4, 4))
    res = s.append(steps(8, 3))  # needs 1 more step: the whole first episode goes
    assert res.evicted_steps == (0, 4) and res.evicted_episodes == (0, 1)
    assert s.step_range == (4, 11) and s.episode_range == (1, 3)
    assert s.read_episodes(np.array([1, 2]))["action"].tolist() == list(range(4, 11))
    with pytest.raises(KeyError, match=r"^'global step 3 is not stored \(stored range \(4, 11\)\)'$"):
        s.read_steps(np.array([3]))


def test_ring_wraps_around_with_correct_data():
    s = Storage(SPECS, 7)
    for i in range(0, 30, 3):
        s.append(steps(i, 3))
    lo, hi = s.step_range
    assert (lo, hi) == (24, 30)
    assert s.read_steps(np.arange(lo, hi))["action"].tolist() == list(range(24, 30))
    w = s.read_windows(np.array([27]), 3, "tail")
    assert w["action"][0].tolist() == [27, 28, 29]


def test_open_episode_continues_across_appends():
    s = Storage(SPECS, 20)
    s.append(steps(0, 3), episode_end=False)
    s.append(steps(3, 2), episode_end=False)
    assert s.open_episode == 0
    s.append(steps(5, 1), episode_end=True)
    assert s.open_episode is None and s.num_episodes == 1
    assert s.read_episodes(np.array([0]))["lengths"].tolist() == [6]


def test_an_append_that_leaves_an_open_episode_filling_the_whole_ring_is_refused():
    """An open episode of exactly the capacity was taken, and then every append was refused (its start
    would have to be evicted), with advice (end episodes sooner) that could no longer be followed: only
    reset() went on (a hostile probe, session 55)."""
    s = Storage(SPECS, 4)
    for ends in (False, np.zeros(4, dtype=bool)):
        with pytest.raises(ValueError, match=r"^this append would leave an open episode of 4 steps, the storage's "
                                             r"whole capacity 4: no step could end it"):
            s.append(steps(0, 4), episode_end=ends)
    s.append(steps(0, 3), episode_end=False)
    with pytest.raises(ValueError, match=r"open episode of 4 steps"):
        s.append(steps(3, 1), episode_end=False)
    s.append(steps(3, 1), episode_end=True)
    assert s.read_episodes(np.array([0]))["lengths"].tolist() == [4]
    # An end inside the append: the open tail after it is what counts (3 steps: taken).
    s.append(steps(4, 4), episode_end=np.array([1, 0, 0, 0], dtype=bool))
    assert s.open_episode is not None and s.num_steps == 4 and s.num_episodes == 2


def test_a_plan_of_no_steps_or_more_than_the_capacity_is_refused():
    """plan_append's kernel reads an append's last end flag unchecked: a plan of 0 steps with an array of no
    flags read the byte before that array's data and answered a plan (its Python, ``ends[-1]``, had raised an
    IndexError). Both bounds are refused, saying them, and the storage is unchanged."""
    s = Storage(SPECS, 4)
    s.append(steps(0, 2), episode_end=False)
    before = snapshot(s)
    for n, ends in ((0, np.zeros(0, dtype=bool)), (0, True), (5, np.zeros(5, dtype=bool)), (-1, True)):
        with pytest.raises(ValueError, match=rf"^an append of {n} steps: a storage of capacity 4 takes 1 to 4$"):
            s.plan_append(n, ends)
    assert same(snapshot(s), before)


def test_episode_end_array_splits_one_append_into_episodes():
    s = Storage(SPECS, 20)
    s.append(steps(0, 6), episode_end=np.array([0, 1, 0, 0, 1, 0], dtype=bool))
    assert s.num_episodes == 3 and s.open_episode == 2
    assert s.read_episodes(np.array([0, 1, 2]))["lengths"].tolist() == [2, 3, 1]


def test_open_episode_outgrowing_capacity_raises_and_changes_nothing():
    s = Storage(SPECS, 8)
    s.append(steps(0, 5), episode_end=False)
    before = snapshot(s)
    with pytest.raises(ValueError, match=r"^open episode 0 \(5 steps \+ 4 appended\) would no longer fit"):
        s.append(steps(5, 4))
    assert same(before, snapshot(s))


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda b: b.update(extra=torch.zeros(5)), KeyError, r"unknown field\(s\) \['extra'\]"),
        (lambda b: b.pop("reward"), KeyError, r"missing field\(s\) \['reward'\]"),
        (lambda b: b.update(obs=torch.zeros(5, 4)), ValueError, r"field 'obs' has shape \(5, 4\), expected"),
        (lambda b: b.update(action=torch.zeros(5, dtype=torch.int32)), TypeError,
         r"field 'action' has dtype torch.int32, expected torch.int64"),
        (lambda b: b.update(reward=torch.zeros(4)), ValueError, r"field 'reward' has 4 steps but field 'obs' has 5"),
        (lambda b: b.update(flag=[True] * 5), TypeError, r"field 'flag' must be a torch.Tensor or numpy array"),
    ],
    ids=["unknown", "missing", "shape", "dtype", "lengths", "type"],
)
def test_bad_append_names_the_field_and_changes_nothing(mutate, error, match):
    s = Storage(SPECS, 8)
    s.append(steps(0, 3))
    before = snapshot(s)
    bad = steps(3, 5)
    mutate(bad)
    with pytest.raises(error, match=match):
        s.append(bad)
    assert same(before, snapshot(s))


def test_any_mapping_of_the_fields_is_accepted_in_any_order():
    """A dict in another order, a read-only mapping proxy and a Mapping whose keys() is a plain list
    append the same steps as the dict (the check of the names is not tied to dict's key views)."""
    import types
    from collections.abc import Mapping

    class Listed(Mapping):
        def __init__(self, d: dict) -> None:
            self.d = d

        def __getitem__(self, k):  # noqa: ANN001, ANN204
            return self.d[k]

        def __iter__(self):  # noqa: ANN204
            return iter(self.d)

        def __len__(self) -> int:
            return len(self.d)

        def keys(self):  # noqa: ANN201
            return list(self.d)

    b = steps(0, 3)
    ref = Storage(SPECS, 8)
    ref.append(b)
    for wrap in (lambda d: dict(reversed(list(d.items()))), types.MappingProxyType, Listed):
        s = Storage(SPECS, 8)
        s.append(wrap(dict(b)))
        assert same(snapshot(ref), snapshot(s))


def test_validated_steps_in_another_order_land_in_their_own_fields():
    """The table hands append its validated tensors and their addresses (``_validated=``); their dict's
    order is not the fields': each is still copied into its own field's ring, by address and (a strided
    source) field by field."""
    for strided in (False, True):
        ref, s = Storage(SPECS, 8), Storage(SPECS, 8)
        b = steps(0, 3)
        if strided:
            b["obs"] = b["obs"].T.contiguous().T
        ref.append(b)
        n, tensors, src = s._validate(b, True)
        assert (0 in src) == strided
        s.append({}, _validated=(n, dict(reversed(list(tensors.items()))), src))
        assert same(snapshot(ref), snapshot(s))


def test_append_longer_than_capacity_raises():
    s = Storage(SPECS, 4)
    with pytest.raises(ValueError, match=r"^append of 5 steps exceeds the storage capacity 4$"):
        s.append(steps(0, 5))
    assert s.num_steps == 0


def test_numpy_arrays_are_accepted_with_matching_dtype():
    s = Storage([FieldSpec("x", (2,), torch.float64)], 4)
    s.append({"x": np.ones((2, 2))})
    assert s.read_steps(np.array([1]))["x"].tolist() == [[1.0, 1.0]]


def test_a_sparse_or_data_less_field_is_refused_before_any_field_is_written():
    """A sparse tensor in the last field failed in the copy, after the fields before it were written
    over the oldest live rows (a hostile probe, session 55); a reversed numpy view failed in torch
    without naming its field."""
    s = Storage(SPECS, 8)
    for i in range(4):
        s.append(steps(2 * i, 2))
    before = snapshot(s)
    for bad in (torch.zeros(2).to_sparse(), torch.empty(2, device="meta")):
        with pytest.raises(TypeError, match=r"^field 'reward' is a .* tensor: a dense \(strided\) tensor with data"):
            s.append({**steps(100, 2), "reward": bad})
        after = snapshot(s)
        assert all(torch.equal(after["fields"][k], v) for k, v in before["fields"].items())
    s.append({**steps(10, 2), "obs": steps(10, 2)["obs"].numpy()[::-1]})
    assert s.read_steps(np.array([8]))["obs"][0].tolist() == [11.0, 11.25, 11.5]


def test_every_kind_of_source_tensor_lands_the_rows_a_plain_one_does():
    """Contiguous CPU sources are copied by address, the rest by numpy or torch: offset slices,
    strided views, tensors that require grad, numpy arrays, conjugate views of a complex field (whose
    bytes are not their values) and a view of the ring's own memory (overlapping: not a memcpy) all
    store what a plain copy of the same values stores, across the ring's end."""
    specs = [FieldSpec("obs", (3,), torch.float32), FieldSpec("z", (), torch.complex64), FieldSpec("n", (), torch.int16)]
    rings: dict[str, torch.Tensor] = {}

    def alloc(name, shape, dtype):  # noqa: ANN001, ANN202 - keeps the ring's tensors to take views of
        rings[name] = torch.zeros(shape, dtype=dtype)
        return rings[name]

    got, ref = Storage(specs, 16, allocator=alloc), Storage(specs, 16)
    g = torch.Generator().manual_seed(0)
    for k in range(12):
        n = 3 + k % 4
        obs = torch.randn(2 * n, 3, generator=g)
        z = torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g))
        num = torch.arange(100 * k, 100 * k + 2 * n, dtype=torch.int16)
        kinds = [
            {"obs": obs[n:], "z": z, "n": num[1 : n + 1]},  # offset slices
            {"obs": obs[::2], "z": z.conj(), "n": num[::2]},  # strided, a conjugate view
            {"obs": obs[:n].clone().requires_grad_(), "z": z.conj().resolve_conj(), "n": num[:n].numpy()},
            {"obs": obs.t().contiguous().t()[:n], "z": torch.view_as_complex(torch.randn(n, 2, generator=g)),
             "n": num[:n].flip(0)},
        ]
        if k >= 2:  # a view of the ring itself, one row before where the rows go: overlapping memory
            p = got.step_range[1] % 16
            a = p - 1 if 1 <= p <= 16 - n + 1 else 0
            kinds.append({"obs": rings["obs"][a : a + n], "z": rings["z"][a : a + n], "n": rings["n"][a : a + n]})
        b = kinds[k % len(kinds)]
        plain = {f: torch.as_tensor(v).detach().resolve_conj().clone() for f, v in b.items()}
        got.append(b, episode_end=k % 3 != 1)
        ref.append(plain, episode_end=k % 3 != 1)
        lo, hi = ref.step_range
        assert got.step_range == (lo, hi)
        a, r = got.read_steps(np.arange(lo, hi)), ref.read_steps(np.arange(lo, hi))
        for f in r:
            assert torch.equal(a[f], r[f]), (k, f)


def test_a_negative_bit_view_stores_its_values_not_its_bytes():
    """The imaginary part of a conjugate view is a real tensor with torch's negative bit: its memory
    holds ``-value``. At one step (or of a ``[L, 1]`` field's one row) it is contiguous, yet its bytes
    are not what it reads as: stored, it reads as its values."""
    s = Storage([FieldSpec("x", (), torch.float32), FieldSpec("y", (2,), torch.float64)], 4)
    for k in range(6):  # across the ring's end
        x = torch.complex(torch.tensor([0.0]), torch.tensor([k + 0.5])).conj().imag
        y = torch._neg_view(torch.tensor([[k, -k - 0.25]], dtype=torch.float64))
        assert x.is_neg() and x.is_contiguous() and y.is_neg() and y.is_contiguous()
        s.append({"x": x, "y": y})
        got = s.read_steps(np.array([k]))
        assert got["x"].tolist() == [-(k + 0.5)] and got["y"].tolist() == [[-k, k + 0.25]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_source_that_requires_grad_leaves_no_graph_in_the_ring(device):
    """A source that requires grad and is copied by torch (strided on the host; any on a GPU): into a
    view of the ring, that would make the ring a node of the caller's graph (holding it alive, and
    every snapshot requiring grad)."""
    import gc
    import weakref

    s = Storage([FieldSpec("obs", (3,), torch.float32)], 4, device=device)
    w = torch.randn(3, requires_grad=True, device=device)
    for _ in range(3):
        x = torch.randn(2 * 3, 3, device=device)
        out = x * w  # an activation of the caller's graph, which saves x for the backward pass
        s.append({"obs": out[::2]})
    saved = weakref.ref(x)
    expected = out[::2].detach().cpu().clone()
    del x, out
    gc.collect()
    assert saved() is None, "the storage keeps the caller's graph alive"
    fields = s.state_dict()["fields"]
    assert not fields["obs"].requires_grad
    assert torch.equal(fields["obs"][-3:], expected)


def test_tail_windows_pad_past_the_episode_end_with_zeros_and_mask():
    s = Storage(SPECS, 32)
    s.append(steps(0, 5))
    s.append(steps(5, 5))
    w = s.read_windows(np.array([1, 3, 5]), 4, "tail")
    assert w["action"].tolist() == [[1, 2, 3, 4], [3, 4, 0, 0], [5, 6, 7, 8]]
    assert w["mask"].tolist() == [[True] * 4, [True, True, False, False], [True] * 4]
    assert w["obs"].shape == (3, 4, 3)
    assert torch.all(w["obs"][1, 2:] == 0)


def test_head_windows_pad_before_the_episode_start_and_never_cross_episodes():
    s = Storage(SPECS, 32)
    s.append(steps(0, 5))
    s.append(steps(5, 5))
    w = s.read_windows(np.array([6, 4]), 3, "head")
    assert w["action"].tolist() == [[0, 5, 6], [2, 3, 4]]
    assert w["mask"].tolist() == [[False, True, True], [True, True, True]]
    assert w["flag"][0, 0].item() is False


def test_n_step_transitions_sum_discounted_rewards_within_the_episode():
    s = Storage(SPECS, 32)
    s.append(steps(0, 6))  # rewards 0..5; the last step (5) holds the final observation
    g = 0.5
    out = s.read_transitions(np.array([0, 3, 4, 5]), n=3, gamma=g, next_fields=("obs",))
    expect_r = [0 + g * 1 + g * g * 2, 3 + g * 4, 4.0, 0.0]
    assert out["reward"].tolist() == pytest.approx(expect_r)
    assert out["discount"].tolist() == pytest.approx([g**3, g**2, g, 1.0])
    assert out["next_obs"][:, 0].tolist() == [3.0, 5.0, 5.0, 5.0]
    assert out["valid"].tolist() == [True, True, True, False]
    assert out["action"].tolist() == [0, 3, 4, 5]


def test_memory_is_raw_bytes_of_steps_plus_a_fixed_index_when_full():
    s = Storage(SPECS, 1000)
    for i in range(0, 1000, 10):
        s.append(steps(i, 10))
    m = s.memory()
    assert m.stored_nbytes == 1000 * (12 + 8 + 4 + 1)
    assert m.data_nbytes <= 1.1 * m.stored_nbytes
    assert m.index_nbytes == 1000 * Storage.INDEX_BYTES_PER_STEP
    assert m.total_nbytes == m.data_nbytes + m.index_nbytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_and_pinned_memory_without_cuda_raise_clearly():
    with pytest.raises(RuntimeError, match=r"^Storage device 'cuda' needs CUDA, but torch.cuda.is_available\(\)"):
        Storage(SPECS, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"^pin_memory=True needs CUDA"):
        Storage(SPECS, 8, pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["pinned", "cuda"])
def test_storage_on_pinned_host_or_cuda_reads_back(placement):
    kw = {"pin_memory": True} if placement == "pinned" else {"device": "cuda"}
    s = Storage(SPECS, 16, **kw)
    s.append(steps(0, 6))
    w = s.read_windows(np.array([4]), 3, "tail")
    assert w["action"].cpu().tolist() == [[4, 5, 0]]
    if placement == "pinned":
        assert s.read_steps(np.array([0]))["obs"].device.type == "cpu"
        assert s._fields["obs"].is_pinned()


def test_state_dict_round_trip_restores_reads_and_the_next_append():
    a = Storage(SPECS, 10)
    for i in range(0, 17, 3):
        a.append(steps(i, 3), episode_end=bool(i % 2))
    b = Storage(SPECS, 10)
    b.load_state_dict(a.state_dict())
    assert same(snapshot(a), snapshot(b))
    ra, rb = a.append(steps(18, 2)), b.append(steps(18, 2))
    assert ra == rb
    lo, hi = a.step_range
    assert torch.equal(a.read_steps(np.arange(lo, hi))["obs"], b.read_steps(np.arange(lo, hi))["obs"])


def test_reset_drops_everything_but_keeps_counting_steps():
    s = Storage(SPECS, 10)
    s.append(steps(0, 4))
    s.reset()
    assert s.num_steps == 0 and s.num_episodes == 0
    assert s.append(steps(0, 2)).first_step == 4


class StorageModel(RuleBasedStateMachine):
    """Storage against a list of episodes (each a list of step values), evicting whole oldest ones."""

    CAP = 12

    def __init__(self) -> None:
        super().__init__()
        self.s = Storage([FieldSpec("v", (), torch.int64)], self.CAP)
        self.episodes: list[list[int]] = []  # (values) oldest first
        self.open = False
        self.next = 0

    @rule(n=st.integers(1, 6), end=st.booleans())
    def append(self, n, end):
        vals = list(range(self.next, self.next + n))
        cur = (self.episodes[-1] if self.open else []) + vals
        older = self.episodes[:-1] if self.open else self.episodes
        stored = sum(len(e) for e in older)
        kept = list(older)
        while kept and stored + len(cur) > self.CAP:
            stored -= len(kept.pop(0))
        if len(cur) > self.CAP or (not end and len(cur) == self.CAP):  # (an open one that fills it: none could end it)
            with pytest.raises(ValueError, match="would no longer fit|the storage's whole capacity"):
                self.s.append({"v": torch.tensor(vals)}, episode_end=end)
            return
        self.s.append({"v": torch.tensor(vals)}, episode_end=end)
        self.episodes = kept + [cur]
        self.open = not end
        self.next += n

    @precondition(lambda self: self.episodes)
    @rule(data=st.data(), length=st.integers(1, 5), pad=st.sampled_from(["head", "tail"]))
    def windows(self, data, length, pad):
        flat = [v for e in self.episodes for v in e]
        step = data.draw(st.sampled_from(flat))
        ep = next(e for e in self.episodes if step in e)
        w = self.s.read_windows(np.array([step]), length, pad)
        base = step if pad == "tail" else step - length + 1
        want = [v if v in ep else 0 for v in range(base, base + length)]
        assert w["v"][0].tolist() == want
        assert w["mask"][0].tolist() == [v in ep for v in range(base, base + length)]
        rows, mask = self.s.plan_windows(np.array([step]), length, pad)
        planned = self.s._fields["v"][torch.from_numpy(rows)] * torch.from_numpy(mask)
        assert torch.equal(planned, w["v"]) and torch.equal(torch.from_numpy(mask), w["mask"])

    @invariant()
    def episodes_match(self):
        lo, hi = self.s.episode_range
        assert hi - lo == len(self.episodes)
        if self.episodes:
            out = self.s.read_episodes(np.arange(lo, hi))
            assert out["lengths"].tolist() == [len(e) for e in self.episodes]
            assert out["v"].tolist() == [v for e in self.episodes for v in e]
        assert self.s.num_steps == sum(len(e) for e in self.episodes)


TestStorageModel = StorageModel.TestCase
TestStorageModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_state_dict_into_snapshot_buffers_matches_and_survives_growth():
    s = Storage(SPECS, 40)
    s.append(steps(0, 4))
    buffers = s.snapshot_buffers()  # sized for 4 + 40 // 4 + 1 = 15 steps
    for i in range(4, 34, 6):
        s.append(steps(i, 6))  # 34 steps now: more than the buffers hold
    a, b = s.state_dict(), s.state_dict(buffers)
    assert all(torch.equal(a["fields"][k], b["fields"][k]) for k in a["fields"])
    small = s.snapshot_buffers()
    s2 = Storage(SPECS, 40)
    s2.load_state_dict(s.state_dict(small))
    assert same(snapshot(s), snapshot(s2))


def test_an_allocator_provides_field_memory_and_a_wrong_tensor_is_refused():
    made = {}

    def alloc(name, shape, dtype):
        made[name] = torch.zeros(shape, dtype=dtype)
        return made[name]

    s = Storage([FieldSpec("obs", (3,)), FieldSpec("reward")], capacity=8, allocator=alloc)
    s.append({"obs": torch.ones(2, 3), "reward": torch.full((2,), 5.0)})
    assert made["obs"][:2].sum().item() == 6.0  # the rows landed in the allocator's memory
    assert made["reward"][1].item() == 5.0
    with pytest.raises(ValueError, match=r"field 'obs' .*expected \(8, 3\) torch.float32"):
        Storage([FieldSpec("obs", (3,))], capacity=8, allocator=lambda n, shape, dt: torch.zeros(8, 4))


def _ring_with_wrapped_episodes() -> Storage:
    """A 64-step ring, written past its end several times, with episodes of 1..9 steps."""
    s = Storage(SPECS, 64)
    rng = np.random.default_rng(0)
    i = 0
    while i < 300:
        n = int(rng.integers(1, 10))
        s.append(steps(i, n), episode_end=bool(rng.integers(0, 4)))
        i += n
    return s


@pytest.mark.parametrize("pad", ["tail", "head"])
def test_plan_windows_gathered_and_masked_equals_read_windows(pad):
    """Regression (issue 3): a reader that maps the field memory gathers F[rows], zeroes ~mask, and
    gets exactly read_windows, including windows that wrap around the ring end."""
    s = _ring_with_wrapped_episodes()
    lo, hi = s.step_range
    keys = np.arange(lo, hi, dtype=np.int64)
    rows, mask = s.plan_windows(keys, 7, pad)
    assert rows.dtype == np.int64 and rows.shape == (len(keys), 7) and mask.dtype == np.bool_
    assert rows.min() >= 0 and rows.max() < s.capacity
    assert ((keys + 6) % 64 < keys % 64).any()  # some windows do cross the ring end
    want = s.read_windows(keys, 7, pad)
    assert torch.equal(torch.from_numpy(mask), want["mask"])
    for name, field in s._fields.items():
        got = field[torch.from_numpy(rows)]
        got[~torch.from_numpy(mask)] = 0
        assert torch.equal(got, want[name]), name


@pytest.mark.parametrize("pad", ["tail", "head"])
def test_window_spans_expand_to_plan_windows_with_each_row_s_global_step(pad):
    """The compact plan a shard sends (3 numbers a window) expands to exactly plan_windows, and the
    versions are the global steps the rows hold (what a sequence-locked reader checks)."""
    s = _ring_with_wrapped_episodes()
    lo, hi = s.step_range
    keys = np.arange(lo, hi, dtype=np.int64)
    spans = s.window_spans(keys, 7, pad)
    assert spans.shape == (len(keys), 3) and spans.dtype == np.int64
    rows, mask, versions = expand_window_spans(spans, 7, s.capacity)
    want_rows, want_mask = s.plan_windows(keys, 7, pad)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(mask, want_mask)
    assert (versions >= lo).all() and (versions < hi).all()  # stored steps, padding included
    np.testing.assert_array_equal(versions % s.capacity, rows)
    anchor = 0 if pad == "tail" else 6
    np.testing.assert_array_equal(versions[:, anchor], keys)  # the item's own step sits at its anchor
    with pytest.raises(ValueError, match=r"^window spans need 0 <= lo < hi <= 7 for every window$"):
        expand_window_spans(np.array([[5, 0, 8]]), 7, 64)
    with pytest.raises(ValueError, match=r"^window spans must be an integer \[B, 3\] array, got dtype float64"):
        expand_window_spans(np.zeros((2, 3)), 7, 64)


def test_plan_windows_padding_rows_point_into_the_window_s_own_episode():
    s = _ring_with_wrapped_episodes()
    lo, hi = s.step_range
    keys = np.arange(lo, hi, dtype=np.int64)
    eps = s.episode_bounds(keys)[0]
    for pad in ("tail", "head"):
        rows, _ = s.plan_windows(keys, 9, pad)
        assert (s._step_ep[rows] == eps[:, None]).all()


@pytest.mark.parametrize("read", ["plan_windows", "read_windows", "window_spans"])
def test_window_reads_reject_bad_arguments_alike(read):
    s = Storage(SPECS, 16)
    s.append(steps(0, 5))
    before = {n: t.clone() for n, t in s._fields.items()}
    fn = getattr(s, read)
    with pytest.raises(KeyError, match=r"^'global step 5 is not stored \(stored range \(0, 5\)\)'$"):
        fn(np.array([1, 5]), 3)
    with pytest.raises(KeyError, match=r"^'global step -1 is not stored \(stored range \(0, 5\)\)'$"):
        fn(np.array([-1]), 3)
    with pytest.raises(ValueError, match=r"^window length must be an int >= 1, got 0$"):
        fn(np.array([1]), 0)
    with pytest.raises(ValueError, match=r"^pad must be 'head' or 'tail', got 'middle'$"):
        fn(np.array([1]), 2, "middle")
    with pytest.raises(ValueError, match=r"^steps must be a 1-D array of global steps, got shape \(1, 1\)$"):
        fn(np.array([[1]]), 2)
    # the stored rows only: the others are uninitialized memory (NaN patterns, bools that are not 0/1)
    assert all(torch.equal(before[n][:5], t[:5]) for n, t in s._fields.items())
    assert s.step_range == (0, 5)


def test_plan_transitions_reconstructs_read_transitions_exactly():
    s = _ring_with_wrapped_episodes()
    lo, hi = s.step_range
    keys = np.arange(lo, hi, dtype=np.int64)
    plan = s.plan_transitions(keys, n=3, gamma=0.9)
    want = s.read_transitions(keys, n=3, gamma=0.9, next_fields=("obs", "flag"))
    for name, field in s._fields.items():
        if name != "reward":
            assert torch.equal(field[torch.from_numpy(plan.rows)], want[name]), name
    for name in ("obs", "flag"):
        assert torch.equal(s._fields[name][torch.from_numpy(plan.next_rows)], want[f"next_{name}"])
    r = s._fields["reward"][torch.from_numpy(plan.reward_rows)]
    reward = (r * torch.from_numpy(plan.reward_coef).float()).sum(1)
    assert torch.equal(reward, want["reward"])
    assert torch.equal(torch.from_numpy(plan.discount).float(), want["discount"])
    assert torch.equal(torch.from_numpy(plan.valid), want["valid"])
    eps = s.episode_bounds(keys)[0]  # every slot read is a stored step of the item's own episode
    assert (s._step_ep[plan.reward_rows] == eps[:, None]).all()
    assert (s._step_ep[plan.next_rows] == eps).all()
    with pytest.raises(ValueError, match=r"^n \(n-step return\) must be an int >= 1, got 0$"):
        s.plan_transitions(keys, n=0)


@pytest.mark.parametrize("pad", ["tail", "head"])
def test_windows_of_odd_widths_match_a_step_by_step_reference_across_the_ring_end(pad):
    """Regression (issue 3): the compiled window copy (one run per field and window, two at the ring
    end) equals gathering each position's step, for rows of 3, 2, 0 and 12 bytes and bfloat16."""
    specs = [FieldSpec("b3", (3,), torch.uint8), FieldSpec("h", (), torch.bfloat16),
             FieldSpec("empty", (0,), torch.float32), FieldSpec("v", (3,), torch.float32)]
    s = Storage(specs, 50)
    rng = np.random.default_rng(1)
    i = 0
    while i < 230:
        n = int(rng.integers(1, 12))
        v = torch.arange(i, i + n)
        s.append({"b3": (v[:, None] * torch.tensor([1, 3, 7])).to(torch.uint8), "h": v.to(torch.bfloat16),
                  "empty": torch.zeros(n, 0), "v": v[:, None].float().repeat(1, 3)}, episode_end=bool(rng.integers(0, 3)))
        i += n
    lo, hi = s.step_range
    keys = np.arange(lo, hi, dtype=np.int64)
    assert (((keys - (9 if pad == "head" else 0)) % 50) + 10 > 50).any()  # windows that cross the ring end
    w = s.read_windows(keys, 10, pad)
    _, start, end = s.episode_bounds(keys)
    base = keys if pad == "tail" else keys - 9
    g = base[:, None] + np.arange(10)[None, :]
    valid = (g >= start[:, None]) & (g < end[:, None])
    assert torch.equal(w["mask"], torch.from_numpy(valid))
    ref = s.read_steps(np.where(valid, g, keys[:, None]).ravel())
    for name in ("b3", "h", "empty", "v"):
        want = ref[name].view(len(keys), 10, *ref[name].shape[1:]).clone()
        want[torch.from_numpy(~valid)] = 0
        assert w[name].dtype == want.dtype and torch.equal(w[name], want), name


@pytest.mark.parametrize("length", [1, 4, 9, 10, 23])
@pytest.mark.parametrize("pad", ["tail", "head"])
def test_window_ranges_give_every_window_its_ring_slot_in_range(pad, length):
    """The window kernels' ring slots (computed from the first stored step without a division)
    are ``base % capacity`` in ``[0, capacity)``: for bases before the first stored step or the
    ring's start (head padding), across the ring end, and for windows longer than the ring."""
    s = Storage(SPECS, 10)
    i = 0
    for n in (3, 4, 2, 5, 3, 4, 6):  # 27 steps: the ring wrapped twice, first_step 17 (slot 7)
        s.append(steps(i, n), episode_end=True)
        i += n
    lo, hi = s.step_range
    assert (lo, hi) == (17, 27)
    keys = np.arange(lo, hi, dtype=np.int64)
    _, pos, wlo, whi = s._window_ranges(keys, length, pad)
    base = keys - (length - 1) if pad == "head" else keys
    np.testing.assert_array_equal(pos, base % 10)
    w = s.read_windows(keys, length, pad)  # and the copy that starts from them
    g = base[:, None] + np.arange(length)[None, :]
    _, start, end = s.episode_bounds(keys)
    valid = (g >= start[:, None]) & (g < end[:, None])
    want = np.where(valid, g, 0).astype(np.float32)
    np.testing.assert_array_equal(w["reward"].numpy(), want)
    np.testing.assert_array_equal(w["mask"].numpy(), valid)
