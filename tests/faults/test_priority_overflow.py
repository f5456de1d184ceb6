"""Numbers that poison: finite priorities whose sum (or whose ``p**alpha``) overflows float64 made the sum
tree's total ``inf``, and every later sample raised ZeroDivisionError. They are refused with a ValueError
naming the key and the value, and the table (or tree) stays bit for bit as it was; absurd sample sizes
are a range error, not a MemoryError.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, SumTree, Table, Uniform, WindowRead

from ._state import bitwise_equal

BIG = 1.5e308  # finite; two of them overflow


def make(alpha: float = 1.0, *, remover=None, max_size=None, capacity: int = 32) -> Table:
    return Table(Storage([FieldSpec("obs", (2,))], capacity), sampler=Prioritized(alpha),
                 remover=Fifo() if remover is None else remover, rate_limiter=MinSize(1), max_size=max_size)


def obs(n: int) -> dict:
    return {"obs": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)}


def _refused(t: Table, call, match: str) -> None:
    before = t.state_dict()
    with pytest.raises(ValueError, match=match):
        call()
    assert bitwise_equal(before, t.state_dict()), "a refused write changed the table"
    _, info = t.sample_nowait(16)  # and the table still samples: no inf total, no ZeroDivisionError
    assert torch.isfinite(info.probabilities).all() and (info.probabilities > 0).all()


def test_updates_whose_sum_overflows_are_refused_naming_key_and_value():
    t = make()
    t.insert_nowait(obs(8), np.ones(8))
    _refused(t, lambda: t.update_priorities([2, 5], [BIG, BIG]),
             r"^priority 1\.5e\+308 for key 2 \(position 0\) is refused by table 'table': priorities \*\* alpha=1\.0: "
             r"the batch sums to inf on top of a total of 8\.0: the total would be inf; nothing was changed")


def test_an_update_that_overflows_only_with_the_stored_total_is_refused():
    t = make()
    t.insert_nowait(obs(8), np.ones(8))
    t.update_priorities([3], [BIG])
    _refused(t, lambda: t.update_priorities([6], [BIG]), r"^priority 1\.5e\+308 for key 6 \(position 0\)")


def test_p_to_the_alpha_that_overflows_is_refused():
    t = make(alpha=2.0)
    t.insert_nowait(obs(8), np.ones(8))
    _refused(t, lambda: t.update_priorities([1, 4], [2.0, 1e200]),
             r"^priority 1e\+200 for key 4 \(position 1\) is refused by table 'table': 1e\+200 \*\* alpha=2\.0 overflows")


def test_inserts_whose_priorities_overflow_are_refused_before_any_step_is_stored():
    t = make()
    t.insert_nowait(obs(8), np.ones(8))
    _refused(t, lambda: t.insert_nowait(obs(4), [1.0, BIG, BIG, 1.0]),
             r"^priority 1\.5e\+308 for key 9 \(position 1\) is refused")
    assert t.storage.step_range == (0, 8)


def test_an_insert_whose_p_to_the_alpha_overflows_is_refused_before_any_step_is_stored():
    """(A prioritized table over host memory checks ``p**alpha`` as it stages an insert's writes in its
    tree, in one pass with the copy; a refusal there still changes nothing.)"""
    t = make(alpha=2.0)
    t.insert_nowait(obs(8), np.ones(8))
    _refused(t, lambda: t.insert_nowait(obs(3), [1.0, 2.0, 1e200]),
             r"^priority 1e\+200 for key 10 \(position 2\) is refused by table 'table': 1e\+200 \*\* alpha=2\.0 overflows")
    assert t.storage.step_range == (0, 8)


def test_lazily_buffered_inserts_count_before_they_are_applied():
    """Inserts only buffer their priorities (applied at the next read); the buffered ones count."""
    t = make()
    t.insert_nowait(obs(4), np.ones(4))
    t.insert_nowait(obs(1), [BIG])  # buffered, not yet in the tree
    _refused(t, lambda: t.insert_nowait(obs(1), [BIG]), r"^priority 1\.5e\+308 for key 5 \(position 0\)")


def test_item_mask_names_the_key_the_refused_item_would_have_had():
    t = make()
    t.insert_nowait(obs(4), np.ones(4))
    mask = np.array([False, True, False, True])  # items on steps 5 and 7 (ignored priorities where False)
    _refused(t, lambda: t.insert_nowait(obs(4), [0.0, BIG, 0.0, BIG], item_mask=mask),
             r"^priority 1\.5e\+308 for key 5 \(position 0\)")


def test_a_prioritized_remover_is_checked_too():
    t = make(remover=Prioritized(3.0), max_size=16)  # fed: max_size < capacity
    t.insert_nowait(obs(4), np.ones(4))
    _refused(t, lambda: t.update_priorities([1], [1e150]), r"^priority 1e\+150 for key 1 \(position 0\).*alpha=3\.0 overflows")


def test_priorities_that_fit_near_the_limit_are_accepted():
    t = make()
    t.insert_nowait(obs(4), np.zeros(4))
    t.update_priorities([0, 1], [BIG / 2, BIG / 2])
    _, info = t.sample_nowait(8)
    assert set(info.keys.tolist()) == {0, 1}


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("lazy", [False, True])
def test_sum_tree_refuses_an_overflowing_write_and_stays_as_it_was(backend, lazy):
    tree = SumTree(16, backend=backend)
    tree.update(np.arange(4), np.ones(4))
    tree.update(np.array([7]), np.array([BIG]), lazy=lazy)
    before = tree.state_dict()
    with pytest.raises(ValueError, match=r"^SumTree priority 1\.5e\+308 at position 1 would overflow the tree "
                       r"\(the batch sums to 1\.5e\+308 on top of a total of 1\.5e\+308: the total would be inf\)"):
        tree.update(np.array([2, 9]), np.array([0.5, BIG]), lazy=lazy)
    after = tree.state_dict()
    assert np.array_equal(before["leaves"], after["leaves"])
    tree.check_invariants()
    assert np.isfinite(tree.total)
    idx, prob = tree.sample(8, np.random.default_rng(0))
    assert (np.asarray(prob) > 0).all()


def test_sum_tree_load_refuses_leaves_whose_sum_overflows():
    tree = SumTree(4)
    with pytest.raises(ValueError, match=r"the leaves sum to inf"):
        tree.load_state_dict({"capacity": 4, "arity": 8, "leaves": np.array([BIG, BIG, 0.0, 0.0])})
    assert tree.total == 0.0


# ------------------------------------------------------------------ absurd sample sizes

@pytest.mark.parametrize("n", [2**62, 10**12, 64 * 32 + 1 + 65536])
def test_a_sample_beyond_any_batch_is_a_range_error(n):
    t = Table(Storage([FieldSpec("obs", (2,))], 32), sampler=Uniform(), remover=Fifo(), rate_limiter=MinSize(1))
    t.insert_nowait(obs(4))
    before = t.state_dict()
    with pytest.raises(ValueError, match=rf"^sample size n={n} is out of range for table 'table': at most "
                       r"max_sample=65536 \(64 draws per slot of capacity 32\)"):
        t.sample_nowait(n)
    assert bitwise_equal(before, t.state_dict())
    assert t.sample_nowait(65536)[1].keys.shape == (65536,)  # the limit itself is allowed


def test_a_sample_larger_than_memory_is_a_range_error():
    """Within max_sample, but each item is a 1000-step window of 84x84x4 bytes (28 MB): the batch could
    never be allocated, and the message says how many items could be."""
    t = Table(Storage([FieldSpec("obs", (84, 84, 4), torch.uint8)], 1024), sampler=Uniform(), remover=Fifo(),
              rate_limiter=MinSize(1), read=WindowRead(1000))
    t.insert_nowait({"obs": torch.zeros(8, 84, 84, 4, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"^sample size n=65536 is out of range for table 'table': its batch would "
                       r"take \d+ bytes, more than this host's \d+ bytes of memory \(at most n=\d+ here\)$"):
        t.sample_nowait(65536)
