"""trainingrun.metrics"""
