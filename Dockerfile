# gptforge image for the compose worker and the Kubernetes job: the repository with its .venv.
# On GPU hosts, base it on a CUDA image and install your CUDA build of torch 2.13.0 first.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential make && rm -rf /var/lib/apt/lists/*
WORKDIR /workspace/gptforge
COPY . .
RUN make setup
ENV PATH=/workspace/gptforge/.venv/bin:$PATH
