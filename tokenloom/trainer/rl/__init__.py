"""RL post-training: tasks, rollout actors, the unbiased replay buffer, GSPO + IcePop, adaptive hints."""
