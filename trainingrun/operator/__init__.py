"""trainingrun.operator"""
