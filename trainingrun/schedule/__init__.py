"""trainingrun.schedule"""
