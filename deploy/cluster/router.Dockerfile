# SGLang's router (sglang-router, a Rust binary in a Python wheel) for deploy/cluster.
#
#   docker build -f deploy/cluster/router.Dockerfile -t mlx-gateway-router deploy/cluster
#
# The version the cluster was measured with (docs/cluster.md): other versions change the
# flags and what the router does to request bodies.
FROM python:3.11-slim-bookworm

RUN pip install --no-cache-dir "sglang-router==0.3.2" \
 && useradd --create-home --uid 10002 router
USER router
ENV NO_COLOR=1
EXPOSE 30000 29000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
