"""trainingrun.rollout"""
