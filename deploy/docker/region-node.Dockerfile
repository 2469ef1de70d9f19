# syntax=docker/dockerfile:1
#
# region-node: multi-stage build, from the repository root:
#   docker build -f deploy/docker/region-node.Dockerfile -t tierlimit/region-node .
#
# The builder is rust:1 on Debian bookworm, so the binary links against the
# same glibc as the debian:bookworm-slim runtime. librdkafka is compiled in
# (rdkafka-sys builds it from source: it needs a C toolchain, make and zlib;
# libssl is there for builds that enable rdkafka's `ssl` feature for TLS/SCRAM).

ARG RUST_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential pkg-config zlib1g-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p region-node \
 && install -m 0755 target/release/region-node /usr/local/bin/region-node

FROM ${RUNTIME_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g libssl3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tierlimit
COPY --from=build /usr/local/bin/region-node /usr/local/bin/region-node
COPY regions.example.toml /etc/tierlimit/regions.example.toml
USER 10001:10001
# Every flag is also an environment variable; config values are overridden
# with TIERLIMIT__SECTION__KEY (e.g. TIERLIMIT__KAFKA__BROKERS).
ENV TIERLIMIT_CONFIG=/etc/tierlimit/tierlimit.toml \
    TIERLIMIT_LISTEN=0.0.0.0:9000 \
    TIERLIMIT_ADMIN_LISTEN=0.0.0.0:9001 \
    TIERLIMIT_LOG_JSON=true \
    RUST_LOG=info
# 9000: the API (keys from [auth]); 9001: /metrics, for Prometheus only.
EXPOSE 9000 9001
# GET /healthz answers 200 while the process serves (bash's /dev/tcp: no
# curl in the slim image).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${TIERLIMIT_LISTEN##*:} && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q ' 200 ' <&3"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/region-node"]
