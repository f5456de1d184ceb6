"""Tuned settings per algorithm and environment (RL-Zoo's way): what ``--set env=ID`` picks up.

``PRESETS[algo][env_id]`` is a flat dict of settings: fields of the app's ``Config`` (the replay
ratio, the target return) and fields of the algorithm's ``Config`` (network size, learning rate) side
by side. An app declares ``PRESETS = PRESETS["dqn"]``; when its config is made (``reactor run``,
``reactor submit``, a worker rebuilding the graph) the preset of the chosen ``env`` goes under the
user's ``--set`` values, over the app's and the algorithm's defaults. An env without a preset runs on
those defaults and with no target return (to ``max_env_steps``): a starting point, not a tuning.

``config.json`` in the run directory records the resolved settings, so a run never depends on
which presets existed when it is loaded again.

Every figure below was measured on this package (``docs/benchmarks.md``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_DQN_CARTPOLE = {"hidden": 256, "lr": 3e-3, "n_step": 5, "target_every": 25, "eps_decay_steps": 8000,
                 "target_return": 475.0}
"""Over reactor.algos.dqn.Config. Measured (seeds 0-13, 50k-step budget): every seed reaches 475, at
5k-13k env steps (median 9k on the machine of that measurement); epsilon falling over 5,000 steps per
actor instead gave 5k-23k (median 10k), over 2,500 median 16k; with the Config defaults (128 units, lr
1e-3, 3-step, target copy every 100 updates) evaluations plateaued at 250-400 and only 2 of 4 seeds
reached 475 within 40k."""

_PPO_CARTPOLE = {"rollout_length": 32, "gamma": 0.98, "gae_lambda": 0.8, "lr": 1e-3, "epochs": 20,
                 "minibatch_size": 256, "clip": 0.2, "ent_coef": 0.0, "target_return": 475.0}
"""RL-Zoo's hyper-parameters for PPO on CartPole-v1 (rl-baselines3-zoo hyperparams/ppo.yml; the linear
decays of lr and clip there are held constant here: they barely move in the ~15k steps a solve takes
out of the zoo's 100k). With 2 actors x 4 envs: 256 samples an update, 20 epochs of one minibatch."""

_SAC_PENDULUM = {"hidden": (64, 64), "actor_lr": 1e-3, "critic_lr": 1e-3, "alpha_lr": 1e-3, "n_step": 3,
                 "learning_starts": 500, "target_return": -200.0, "max_env_steps": 30_000}
"""Over reactor.algos.sac.Config's paper defaults. Measured as learner updates to a -200 evaluation
(evaluations every 250): 1-step returns need about 2,900 (3 seeds), 3-step returns about 1,900 (6 seeds;
median 1,625 with prioritized replay, 1,875 uniform); 256-unit layers needed as many updates as 64-unit
ones for twice the CPU time (one seed); 500 random steps before learning instead of 1,000 save env steps
and change nothing else."""

_TD3_PENDULUM = {"hidden": (64, 64), "actor_lr": 1e-3, "critic_lr": 1e-3, "tau": 0.01, "n_step": 3,
                 "learning_starts": 500, "target_return": -200.0, "max_env_steps": 30_000}
"""Over reactor.algos.td3.Config's paper defaults. Measured as learner updates to a -200 evaluation
(evaluations every 250): the paper's tau 0.005 with 1-step returns needs about 5,300 (2 seeds); tau 0.01
(the targets move only every policy_frequency updates) about 2,900; with 3-step returns as well, a median
of 1,625 with prioritized replay and 2,125 uniform (6 seeds each)."""

_DDPG_PENDULUM = {"hidden": (64, 64), "actor_lr": 1e-3, "critic_lr": 1e-3, "n_step": 3, "learning_starts": 500,
                  "target_return": -200.0, "max_env_steps": 30_000}
"""Over reactor.algos.ddpg.Config's defaults. Measured as learner updates to a -200 evaluation (3 seeds,
evaluations every 250): about 3,600 with 1-step returns, 2,400 with 3-step returns, 1,700 with 3-step
returns and prioritized replay."""

_TRANSFORMER_NOVEL = {"target_return": 400.0}
"""The transformer agent's Config defaults are its CartPoleNoVel tuning (reactor.algos.transformer_dqn):
all five seeds reach 400 (docs/benchmarks.md)."""

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "dqn": {"CartPole-v1": _DQN_CARTPOLE},
    "ppo": {"CartPole-v1": _PPO_CARTPOLE},
    "sac": {"Pendulum-v1": _SAC_PENDULUM},
    "td3": {"Pendulum-v1": _TD3_PENDULUM},
    "ddpg": {"Pendulum-v1": _DDPG_PENDULUM},
    "transformer_dqn": {"CartPoleNoVel-v1": _TRANSFORMER_NOVEL},
}
