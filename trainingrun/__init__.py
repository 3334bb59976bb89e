"""trainingrun: LLM post-training on Kubernetes with a global batch size that varies from step to step."""

__version__ = "0.1.0"
