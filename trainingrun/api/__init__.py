"""trainingrun.api"""
