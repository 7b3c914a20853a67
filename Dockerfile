# One image for the three services; the Kubernetes manifests pick the service:
#   python -m specdec serve coordinator|draft|verify   (flags or SPECDEC_* environment variables)
#
# CPU image (torch's CPU wheels):
#   docker build -t specdec:cpu .
# GPU image: the same torch pin from a CUDA wheel index, or another pin altogether:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t specdec:gpu .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                --build-arg TORCH_REQUIREMENT="torch==<version>" -t specdec:gpu .
# The CUDA wheels bundle the CUDA runtime; the node needs only the NVIDIA driver and device plugin.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# Where torch comes from, and (optionally) a line that replaces the `torch==...` pin of requirements.txt.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_REQUIREMENT=

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # The root filesystem is read-only in the cluster: every cache goes under /tmp (an emptyDir there).
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/huggingface \
    MPLCONFIGDIR=/tmp/matplotlib

WORKDIR /app

# g++ builds the CPU attention kernel when a CPU service first starts (specdec/engine/attention/ragged_attention.py; cached under
# $XDG_CACHE_HOME/torch_extensions); GPU services do not use it.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

COPY requirements.txt .
RUN if [ -n "$TORCH_REQUIREMENT" ]; then sed -i "s|^torch==.*|${TORCH_REQUIREMENT}|" requirements.txt; fi \
 && torch_line="$(grep -E '^torch([=<>!~ ;]|$)' requirements.txt)" \
 && pip install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple "$torch_line" \
 && pip install -r requirements.txt

# The code and the embedded demo model pair (models/, the services' default models).
COPY . .
RUN python -m compileall -q specdec coordinator draft_service verify_service \
 && groupadd --gid 10001 specdec \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp specdec

# Numeric, so that Kubernetes can check runAsNonRoot.
USER 10001:10001
EXPOSE 50051 50061 50062
ENTRYPOINT ["python", "-m", "specdec"]
CMD ["serve", "coordinator"]
