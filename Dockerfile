# fs3: one image for every service (mgmtd, meta, storage), for FUSE clients and for the HAI Platform's
# server and agents (entrypoint hai).
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends fuse3 libfuse3-dev pkg-config gcc make util-linux \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/fs3
COPY pyproject.toml README.md Makefile ./
COPY proto ./proto
COPY fs3 ./fs3
COPY hai ./hai
# Generate the protobuf modules and gRPC stubs (and ship the .proto files in the package, as
# `make proto` does), then install fs3 with the FUSE extra.
RUN pip install --no-cache-dir "grpcio-tools>=1.60" \
 && python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/fs3/*.proto \
 && mkdir -p fs3/proto/fs3 && cp proto/fs3/*.proto fs3/proto/fs3/ \
 && pip install --no-cache-dir ".[fuse]" \
 && pip uninstall -y grpcio-tools

ENV FS3_LOG_LEVEL=INFO
ENTRYPOINT ["fs3"]
CMD ["--help"]
