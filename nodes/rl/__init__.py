"""The asynchronous RL loop as node roles: trainer ranks and rollout workers (torch)."""
