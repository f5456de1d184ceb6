"""linear_q whose update number ``$REACTOR_CUT_AT`` is cut short by an error once its optimizer has
stepped, before it counts the update: the networks changed, the counters not (as an algorithm's bug, a
device out of memory or a failed all-reduce between two optimizers' steps leaves a state)."""

from __future__ import annotations

import os

import torch

from tests.nodes import linear_q as _base
from tests.nodes.linear_q import (  # noqa: F401 - the rest of the fragment contract, as linear_q's
    KIND,
    Config,
    State,
    act,
    init,
    load_state_dict,
    load_weights,
    make_policy,
    policy_weights,
    state_dict,
    store,
)


def learn(state: State, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], torch.Tensor]:
    if state.updates + 1 != int(os.environ.get("REACTOR_CUT_AT", "0")):
        return _base.learn(state, batch)
    loss = state.q(batch["obs"]).pow(2).mean()
    state.opt.zero_grad()
    loss.backward()
    state.opt.step()
    raise RuntimeError(f"update {state.updates + 1} broke after its optimizer step")
