# gptforge image: the repository and its .venv, for the compose worker and the Kubernetes job.
#   docker build -t gptforge:latest .                                                  (CPU)
#   docker build -t gptforge:cuda --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .                 (GPU: torch 2.13.0+cu128)
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=0
RUN apt-get update && apt-get install -y --no-install-recommends build-essential make git openssh-client \
        python3 python3-venv python3-dev bubblewrap && rm -rf /var/lib/apt/lists/*
WORKDIR /workspace/gptforge
# torch first, from the index that matches the base (CPU or CUDA): `make setup` keeps the torch it finds
RUN python3 -m venv .venv && .venv/bin/pip install --index-url ${TORCH_INDEX} torch==2.13.0
COPY . .
RUN make setup
ENV PATH=/workspace/gptforge/.venv/bin:$PATH
CMD ["gptforge", "--help"]
