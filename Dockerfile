# syntax=docker/dockerfile:1
# spectune API (with optuna-dashboard) and, for demos, the simulated worker.
#   docker build -t spectune .
#   docker compose up -d                 # Postgres + migration + API; see README "Deployment"
# GPU hosts run the worker under systemd instead (workers/systemd/), next to SGLang.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TZ=UTC

# The CPU build of torch first (the `gp` sampler needs torch, never CUDA on the API host), so
# that installing the package below finds torch satisfied and never pulls a multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4,<3"

WORKDIR /opt/spectune/src
COPY pyproject.toml README.md ./
COPY api ./api
COPY optimizer ./optimizer
COPY workers ./workers
COPY spectune_sim ./spectune_sim
COPY migrations ./migrations
COPY spectune ./spectune
COPY spectune_protocol ./spectune_protocol
RUN pip install '.[server,gp,sim]' && rm -rf /opt/spectune/src

# An unprivileged user; /var/lib/spectune holds artifacts (API) or the outbox (worker), and
# /run/spectune the simulated worker's token (shared volumes are initialised from these dirs).
RUN useradd --system --uid 10001 --home-dir /var/lib/spectune --shell /usr/sbin/nologin spectune \
 && install -d -o spectune -g spectune -m 0750 /var/lib/spectune /var/lib/spectune/artifacts \
      /var/lib/spectune/secrets /run/spectune \
 && install -d -o root -g root -m 0755 /opt/spectune/sim-models/moe-pcie /opt/spectune/sim-models/moe-pcie-eagle3 \
      /opt/spectune/sim-models/dense-8b-h100 /opt/spectune/sim-models/dense-8b-h100-eagle3

# The simulated worker's config (compose profile `sim`): the simulated engine, a model registry
# of empty folders whose names pick the simulator's landscape.
COPY <<'TOML' /etc/spectune/sim-worker.toml
api_url = "http://api:8000"
token_file = "/run/spectune/worker.token"
worker_id = "sim-1"
outbox_dir = "/var/lib/spectune/outbox"
idle_poll_s = 2
idle_poll_max_s = 10

[engine]
module = "spectune_sim"
port = 30000
sglang_version = "0.5.23"
log_dir = "/var/lib/spectune/logs"

[engine.env]
SPECTUNE_SIM_SPEED = "20"
SPECTUNE_SIM_TIME_SCALE = "0.004"

[models]
"moe-pcie" = "/opt/spectune/sim-models/moe-pcie"
"moe-pcie-eagle3" = "/opt/spectune/sim-models/moe-pcie-eagle3"
"dense-8b-h100" = "/opt/spectune/sim-models/dense-8b-h100"
"dense-8b-h100-eagle3" = "/opt/spectune/sim-models/dense-8b-h100-eagle3"

[labels]
sim = "true"
TOML

USER spectune
WORKDIR /var/lib/spectune
ENV SPECTUNE_ARTIFACT_DIR=/var/lib/spectune/artifacts
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
ENTRYPOINT ["spectune"]
CMD ["server", "--host", "0.0.0.0", "--port", "8000"]
