"""linear_q whose ``act`` also records the first exploration step it is given in each process (in the
file named by ``$REACTOR_EXPLORE_PROBE``): a test sees where an actor's schedule starts."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.nodes import linear_q as _base
from tests.nodes.linear_q import (  # noqa: F401 - the rest of the fragment contract, as linear_q's
    KIND,
    Config,
    init,
    learn,
    load_state_dict,
    load_weights,
    make_policy,
    policy_weights,
    state_dict,
    store,
)

_SEEN = False


def act(policy: dict[str, Any], obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    global _SEEN
    if not greedy and not _SEEN and os.environ.get("REACTOR_EXPLORE_PROBE"):
        _SEEN = True
        with open(os.environ["REACTOR_EXPLORE_PROBE"], "a") as f:
            f.write(f"{step}\n")
    return _base.act(policy, obs, step, generator, greedy)
