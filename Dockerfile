# syntax=docker/dockerfile:1
# Three images from one Dockerfile (docs/install.md says which serves which hardware):
#   docker build --target operator   -t ghcr.io/trainingrun/operator:0.1.0   .  # Kopf operator, slim Python
#   docker build --target trainer-te -t ghcr.io/trainingrun/trainer-te:0.1.0 .  # rollout + trainer pods: NVIDIA's
#                                                                               # PyTorch, TransformerEngine (GPUs)
#   docker build --target trainer    -t ghcr.io/trainingrun/trainer:0.1.0    .  # rollout + trainer pods: slim CUDA
#                                                                               # PyTorch (CPU, GPUs without TE)
# A plain `docker build .` gives the last stage, `trainer`. .github/workflows/release.yml builds and pushes all three
# on a version tag. Bases are pinned by exact release tag, NVIDIA's also by digest (add @sha256 digests for the
# others in your registry mirror for fully reproducible builds).
# All run as the non-root user 10001, which the Helm chart's securityContext expects.

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

# ---------------------------------------------------------------------------------------------- trainer-te
# NVIDIA's PyTorch container, release 26.04 (the multi-arch index pinned by digest; built here for linux/amd64):
# Ubuntu 24.04, Python 3.12.3, torch 2.12.0a0+0291f960b6 (nv26.04), CUDA 13.2.1, cuDNN 9.21, NCCL 2.29.7,
# TransformerEngine 2.14 (fused and flash attention on packed THD input; the build records the exact versions),
# triton, and torch's own flash kernels (scaled_dot_product_attention, torch.nn.attention.varlen). Needs an NVIDIA
# driver for CUDA 13 (>= 580).
# megatron-core 0.18.2: the release whose own CI ran on this container (0.17+ need Python 3.12).
FROM nvcr.io/nvidia/pytorch:26.04-py3@sha256:192d749b4d773610ec9e01c0443a9df545d196c412b7b8fd33bfa3da362a49e7 AS trainer-te
LABEL org.opencontainers.image.title="trainingrun-trainer-te" \
      org.opencontainers.image.description="Rollout and Megatron-core trainer processes of a TrainingRun, with TransformerEngine" \
      org.opencontainers.image.source="https://github.com/trainingrun/trainingrun" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/trainingrun
COPY pyproject.toml README.md ./
COPY trainingrun ./trainingrun
# The container's GPU stack stays as NVIDIA built it: its torch, torchvision, TransformerEngine, flash-attn, triton
# and apex are pinned to their installed versions (in place of the container's global pip constraints, which would
# also freeze every other package it ships), so pip adds megatron-core and the extras around them or fails, never
# replaces them. The build then checks that TransformerEngine and torch's variable-length attention are there and
# records the versions in /opt/trainingrun/image-versions.txt.
RUN python -m pip list --format=freeze \
      | grep -iE '^(torch|torchvision|transformer[-_]engine[a-z0-9_-]*|flash[-_]attn[a-z0-9_-]*|triton|pytorch[-_]triton|apex)==' \
      > /opt/trainingrun/gpu-stack.txt \
 && PIP_CONSTRAINT=/opt/trainingrun/gpu-stack.txt python -m pip install --no-cache-dir \
      "megatron-core==0.18.2" "/opt/trainingrun[train,rl,wandb]" \
 && python -m pip list --format=freeze | grep -iE '^(torch|transformer[-_]engine|flash[-_]attn|triton|megatron[-_]core)' \
      > /opt/trainingrun/image-versions.txt \
 && python -c "import importlib.metadata as m, importlib.util as u; m.version('transformer_engine'); \
assert u.find_spec('torch.nn.attention.varlen'), 'torch without torch.nn.attention.varlen'" \
 && groupadd --gid 10001 trainingrun \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/trainingrun --shell /usr/sbin/nologin trainingrun \
 && mkdir -p /checkpoints \
 && chown 10001:10001 /checkpoints
ENV HOME=/home/trainingrun
WORKDIR /home/trainingrun
USER 10001:10001
EXPOSE 9400
# NVIDIA's entry script first (CUDA forward-compatibility set-up, banner), then the program; a pod's `command`
# replaces both.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "trainingrun"]
CMD ["trainer"]

# ------------------------------------------------------------------------------------------------- trainer
# Slim CUDA PyTorch base (torch 2.5.1, CUDA 12.4, Python 3.11; no TransformerEngine): megatron-core 0.16.1 is the
# newest release for Python 3.11. CPU-only clusters and CUDA GPUs without TE (attention through SDPA).
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
