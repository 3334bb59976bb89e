"""trainingrun.trainer"""
