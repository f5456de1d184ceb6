"""Offline: a decoder-only transformer learns from trajectories reactor's own agents wrote (GEAR's workload).

    reactor run apps/transformer_dqn.py --set max_env_steps=20000 --set target_return=None --set run_dir=runs/src
    reactor run apps/transformer_offline.py --set source=runs/src                    # a small model, on the CPU
    reactor run apps/transformer_offline.py --set source=runs/src --set size=large --set device=cuda
                                                  # 57M parameters, window 64, bf16 autocast, replay on the GPU

The first command's replay shards checkpoint their steps into runs/src/replay-<i>/. Here one learner loads
them all into a replay resident on its device (reactor.replay.device.DeviceReplay), samples windows by
priority and gathers them there, and learns transformer_dqn (offline double DQN over windows) on them; an
evaluator plays the greedy policy in the env every eval_every_updates updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from reactor import Graph
from reactor.nodes.apps import OfflineAppConfig, offline_app_graph

ALGO = "transformer_dqn"

SIZES = {
    "small": {},  # transformer_dqn's CartPoleNoVel tuning (window 8, d_model 64, 2 layers)
    "large": {"window": 64, "d_model": 768, "n_heads": 12, "n_layers": 8, "d_ff": 3072, "lr": 1e-4},  # 56.8M
}


@dataclass(frozen=True)
class Config(OfflineAppConfig):
    """Every field of OfflineAppConfig (settable with --set), and the model's size."""

    env: str = "CartPoleNoVel-v1"
    size: Literal["small", "large"] = "small"
    """"small" (CPU) or "large" (56.8M parameters, window 64: for a GPU); algorithm fields set directly
    (--set d_model=256) go over it."""


def build(config: Config) -> Graph:
    if config.size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {config.size!r}")
    return offline_app_graph(config, algo=ALGO, name="transformer_offline", title="Transformer offline",
                             algo_config=SIZES[config.size])
