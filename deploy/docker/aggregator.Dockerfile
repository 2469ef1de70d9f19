# syntax=docker/dockerfile:1
#
# aggregator: multi-stage build, from the repository root:
#   docker build -f deploy/docker/aggregator.Dockerfile -t tierlimit/aggregator .
#
# The same image creates the topics once per Kafka cluster:
#   docker run --rm -v $PWD/tierlimit.toml:/etc/tierlimit/tierlimit.toml \
#     tierlimit/aggregator create-topics
#
# librdkafka is compiled in (rdkafka-sys builds it from source: it needs a C
# toolchain, make and zlib; libssl is there for builds that enable rdkafka's
# `ssl` feature for TLS/SCRAM).

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
    cargo build --release --locked -p aggregator \
 && install -m 0755 target/release/aggregator /usr/local/bin/aggregator

FROM ${RUNTIME_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g libssl3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tierlimit
COPY --from=build /usr/local/bin/aggregator /usr/local/bin/aggregator
USER 10001:10001
ENV TIERLIMIT_CONFIG=/etc/tierlimit/tierlimit.toml \
    TIERLIMIT_LISTEN=0.0.0.0:9100 \
    TIERLIMIT_ADMIN_LISTEN=0.0.0.0:9101 \
    TIERLIMIT_LOG_JSON=true \
    RUST_LOG=info
# 9100: the API (keys from [auth]); 9101: dashboard and /metrics, for operators.
EXPOSE 9100 9101
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${TIERLIMIT_LISTEN##*:} && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q ' 200 ' <&3"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/aggregator"]
