"""Reinforcement learning with verifiable rewards: the rewards (rewards.py)."""
