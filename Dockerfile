# syntax=docker/dockerfile:1
# Two images from one Dockerfile:
#   docker build --target operator -t ghcr.io/trainingrun/operator:0.1.0 .   # Kopf operator, slim Python
#   docker build --target trainer  -t ghcr.io/trainingrun/trainer:0.1.0  .   # rollout + trainer pods, CUDA PyTorch
# Bases are pinned by exact tag (add @sha256 digests in your registry mirror for fully reproducible builds).
# Both run as the non-root user 10001, which the Helm chart's securityContext expects.

# ------------------------------------------------------------------------------------------------ operator
FROM python:3.11.11-slim-bookworm AS operator-build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainingrun ./trainingrun
RUN pip install --no-cache-dir "/src[operator]"

FROM python:3.11.11-slim-bookworm AS operator
LABEL org.opencontainers.image.title="trainingrun-operator" \
      org.opencontainers.image.description="Kopf operator reconciling TrainingRun resources" \
      org.opencontainers.image.source="https://github.com/trainingrun/trainingrun" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 trainingrun \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin trainingrun
COPY --from=operator-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
# metrics, liveness (see charts/trainingrun/values.yaml: operator.metricsPort / operator.livenessPort)
EXPOSE 8080 8081
ENTRYPOINT ["trainingrun"]
CMD ["operator"]

# ------------------------------------------------------------------------------------------------- trainer
# CUDA PyTorch base (torch 2.5.1, CUDA 12.4, Python 3.11): megatron-core 0.16.1 is the newest release for Python 3.11.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime AS trainer
LABEL org.opencontainers.image.title="trainingrun-trainer" \
      org.opencontainers.image.description="Rollout and Megatron-core trainer processes of a TrainingRun" \
      org.opencontainers.image.source="https://github.com/trainingrun/trainingrun" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/trainingrun
COPY pyproject.toml README.md ./
COPY trainingrun ./trainingrun
# The base image's torch satisfies `torch>=2.4`, so pip keeps it and adds only megatron-core and the extras.
RUN pip install --no-cache-dir "megatron-core==0.16.1" "/opt/trainingrun[train,rl,wandb]" \
 && groupadd --gid 10001 trainingrun \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/trainingrun --shell /usr/sbin/nologin trainingrun \
 && mkdir -p /checkpoints \
 && chown 10001:10001 /checkpoints
ENV HOME=/home/trainingrun
WORKDIR /home/trainingrun
USER 10001:10001
EXPOSE 9400
ENTRYPOINT ["trainingrun"]
CMD ["trainer"]
