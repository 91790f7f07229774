# fs3: one image for every service (mgmtd, meta, storage), for FUSE clients and for the HAI Platform's
# server and agents (entrypoint hai).
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends fuse3 libfuse3-dev pkg-config gcc make util-linux \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/fs3
COPY pyproject.toml setup.py MANIFEST.in README.md Makefile ./
COPY proto ./proto
COPY fs3 ./fs3
COPY hai ./hai
# Installs fs3 with the FUSE extra; the build generates the protobuf modules and gRPC stubs and ships the
# .proto files in the package (setup.py), with grpcio-tools in the build's own environment only.
RUN pip install --no-cache-dir ".[fuse]"

ENV FS3_LOG_LEVEL=INFO
ENTRYPOINT ["fs3"]
CMD ["--help"]
