"""Toy RL pieces for ``refbus up``: a tiny MoE policy, a learnable task and a policy-gradient train step."""
