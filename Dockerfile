# The collector (API, /metrics and the web UI on one port). The agent is installed in the
# trainer's own image with `pip install "trainwarden[agent]"`.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY collector ./collector
COPY alerts ./alerts
COPY webui ./webui
COPY migrations ./migrations
COPY runbooks ./runbooks
RUN pip install --no-cache-dir ".[server,k8s]"
EXPOSE 8000
# --host 0.0.0.0: reachable from other containers and from the host's published port.
CMD ["trainwarden", "serve", "--host", "0.0.0.0", "--port", "8000"]
