# Multi-stage build: compile in the Rust image, run from a small Debian image as a non-root user.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p aqueduct-cli \
 && strip target/release/aqueduct-broker target/release/aqueduct

FROM debian:bookworm-slim
# ca-certificates: the system roots an https:// OTLP collector is verified against by default.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home /var/lib/aqueduct --create-home aqueduct
COPY --from=build /src/target/release/aqueduct-broker /src/target/release/aqueduct /usr/local/bin/
USER aqueduct
ENV AQUEDUCT_HOME=/var/lib/aqueduct
# The broker's metrics and health endpoint listens on loopback by default (docs/metrics.md):
# reach it from outside the container with `-e AQUEDUCT_METRICS_ADDR=0.0.0.0:9090` (or
# `metrics_addr` in the configuration; the compose files and the Helm chart set it). Not set
# here: an image variable would override every configuration file's `metrics_addr`.
EXPOSE 4242/udp 9090/tcp
ENTRYPOINT ["aqueduct-broker"]
