# prefix-router's container image.
#
#   docker build -t prefix-router .
#   docker run --rm --read-only --tmpfs /tmp -p 8080:8080 \
#     -v "$PWD/config.toml:/etc/prefix-router/config.toml:ro" prefix-router
#   docker run --rm -p 8080:8080 prefix-router --backend gpu-0=http://10.0.0.10:8000
#
# The entrypoint is `prefix-router serve --config /etc/prefix-router/config.toml`:
# mount your own file over the default one (deploy/docker/config.toml: listens on
# 0.0.0.0:8080, admin API on 127.0.0.1:9091, no backends), and any arguments after
# the image name are more `serve` flags, which override the file.  The admin token
# can come from the environment (PREFIX_ROUTER_ADMIN_TOKEN) or a mounted file
# (--admin-token-file); an admin API off loopback needs one.
#
# Nothing is written outside /tmp and /var/lib/prefix-router (the place for
# --state-file, owned by the image's user), so `--read-only` works; logs go to
# stderr and the access log to stdout.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- builder: the project's wheel and the wheels of its runtime dependencies ------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the wheel is built from (.dockerignore keeps the rest out of the context).
COPY pyproject.toml README.md LICENSE ./
COPY hashring/ hashring/
COPY router/ router/
COPY admin/ admin/
# uvloop, httptools, mmh3, msgspec and aiohttp ship manylinux wheels for CPython
# 3.11 on x86_64 and aarch64, so no compiler is needed here.  The wheels go into a
# virtual environment without pip: the project and its runtime dependencies only
# (no build tools, no dev extra), compiled to bytecode now so nothing is written
# at run time.  Both stages share the base image, so its interpreter path holds.
RUN pip wheel --wheel-dir /wheels . \
 && python -m venv --without-pip /opt/prefix-router \
 && pip --python /opt/prefix-router/bin/python install --no-index --find-links /wheels \
      prefix-router

# -- runtime: slim Python, the wheels installed, nothing else -----------------------
FROM ${PYTHON_IMAGE} AS runtime
# A fixed, unprivileged UID/GID outside the range distributions hand out, so a
# Kubernetes securityContext (runAsUser/fsGroup) and volume ownership can name it.
ARG UID=10001
ARG GID=10001
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/prefix-router/bin:$PATH \
    PREFIX_ROUTER_HEALTH_URL=http://127.0.0.1:9091/healthz
RUN groupadd --system --gid "${GID}" prefix-router \
 && useradd --system --uid "${UID}" --gid "${GID}" --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin prefix-router \
 && install -d -o "${UID}" -g "${GID}" -m 0750 /var/lib/prefix-router
# Only the environment crosses over: no wheels, no sources, no build layer.  (No
# RUN --mount either, so the legacy builder builds this too.)
COPY --from=builder /opt/prefix-router /opt/prefix-router
COPY deploy/docker/config.toml /etc/prefix-router/config.toml
USER ${UID}:${GID}
WORKDIR /var/lib/prefix-router
# 8080: the data plane (clients); 9091: the admin API (/healthz, /readyz, /metrics).
EXPOSE 8080 9091
# No curl in slim: the stdlib asks the admin API's /healthz (200 while the process
# and its event loop run), bypassing any HTTP(S)_PROXY of the environment.  With
# the admin API elsewhere (or off), set PREFIX_ROUTER_HEALTH_URL (or --no-healthcheck).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(os.environ['PREFIX_ROUTER_HEALTH_URL'], timeout=2)"]
# SIGTERM (docker stop, Kubernetes) stops accepting, lets in-flight requests finish
# for up to timeouts.shutdown_grace (30 s by default), then exits 0: give the
# container longer than that (docker stop -t 40; terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["prefix-router", "serve", "--config", "/etc/prefix-router/config.toml"]
CMD []
