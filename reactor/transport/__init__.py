"""How bytes move between processes and hosts. Knows nothing of RL."""
