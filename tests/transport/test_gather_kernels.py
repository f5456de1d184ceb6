"""The compiled gather helpers on their own: zeroing padding rows across several fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reactor.transport import _gather


def test_zero_rows_clears_exactly_the_given_rows_of_every_field_and_checks_bounds_first():
    obs = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) + 1
    act = torch.arange(6, dtype=torch.int64) + 1
    addrs = np.array([obs.data_ptr(), act.data_ptr()], dtype=np.int64)
    sizes = np.array([4 * 4, 8], dtype=np.int64)
    _gather.zero_rows(addrs, 6, sizes, np.array([1, 4], dtype=np.int64))
    assert obs[[1, 4]].eq(0).all() and obs[[0, 2, 3, 5]].ne(0).all()
    assert act.tolist() == [1, 0, 3, 4, 0, 6]
    before = (obs.clone(), act.clone())
    with pytest.raises(IndexError, match=r"^zero_rows: a position outside \[0, 6\)$"):
        _gather.zero_rows(addrs, 6, sizes, np.array([2, 6], dtype=np.int64))
    assert torch.equal(obs, before[0]) and torch.equal(act, before[1])  # nothing written
    _gather.zero_rows(addrs, 6, sizes, np.array([], dtype=np.int64))  # no positions: a no-op
    assert torch.equal(obs, before[0])
