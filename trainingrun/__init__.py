"""trainingrun: LLM post-training on Kubernetes with a global batch size that varies from step to step."""

__version__ = "0.1.0"

API_GROUP = "trainingrun.dev"
API_VERSION = "v1alpha1"
KIND = "TrainingRun"
PLURAL = "trainingruns"
SHORT_NAME = "tr"
