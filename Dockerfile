# One image for every role: api, scheduler, worker. CPU torch by default; GPU workers use the same
# image built with CUDA torch: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t trainyard:gpu
# (docker-compose.yml's worker-gpu and the Kubernetes DaemonSet do).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# `hf`: transformers models and load_from_disk datasets; build with --build-arg EXTRAS= for a leaner image.
ARG EXTRAS=hf
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api_schemas api_schemas
COPY common common
COPY service service
COPY workers workers
COPY trainyard trainyard
COPY stack stack
COPY data data
RUN pip install --no-cache-dir --extra-index-url ${TORCH_INDEX} ".${EXTRAS:+[$EXTRAS]}"
ENV TRAINYARD_ARTIFACT_ROOT=/var/lib/trainyard/artifacts \
    TRAINYARD_DATA_ROOT=/var/lib/trainyard/data \
    TRAINYARD_WORK_ROOT=/var/lib/trainyard/work
EXPOSE 8000
ENTRYPOINT ["trainyard"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
