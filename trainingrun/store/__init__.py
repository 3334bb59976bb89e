"""trainingrun.store"""
