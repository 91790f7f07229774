# fs3 — the two commands a newcomer needs are `make run` and `make test`; `make check` is the quick tier.
SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.fs3-installed
PROTO_SRC := $(wildcard proto/fs3/*.proto)
PROTO_OUT := $(patsubst proto/%.proto,%_pb2.py,$(PROTO_SRC))
PROTO_GRPC_OUT := $(patsubst proto/%.proto,%_pb2_grpc.py,$(PROTO_SRC))
PROTO_SHIPPED := $(patsubst proto/%,fs3/proto/%,$(PROTO_SRC))
SEEDS ?= 2000
FIRST ?= 1
MODEL_EXAMPLES ?= 1000
JOBS ?=
PYTEST_ARGS ?=
FSX_SEEDS ?= 300
FSX_OPS ?= 100
FSX_FIRST ?= 1
LIN_SEEDS ?= 20
LIN_OPS ?= 40
BENCH_HAI_ARGS ?=
BENCH_USRBIO_ARGS ?=

.PHONY: run test check proto lint typecheck sim sim-meta meta-linearizable meta-backup fsx bench bench-quick bench-chunk bench-meta bench-file bench-fuse bench-usrbio bench-fuse-workers bench-hfreduce bench-haiscale bench-hai train-demo hai-demo scrub-demo drain-demo test-haiscale-long trash-long quota-long chaos rolling-upgrade model-report clean install test-wheel

$(STAMP): pyproject.toml constraints.txt scripts/bootstrap.sh tests/grpc_node/package-lock.json
	./scripts/bootstrap.sh
	@touch $(STAMP)

install: $(STAMP) proto

# Generated protobuf modules land next to the package (fs3/*_pb2.py, and the gRPC stubs
# fs3/*_pb2_grpc.py) and are never edited by hand; the .proto files ship inside the package too
# (fs3/proto/fs3/*.proto), for clients in other languages (docs/grpc.md).
proto: $(STAMP) $(PROTO_OUT) $(PROTO_GRPC_OUT) $(PROTO_SHIPPED)

fs3/%_pb2.py fs3/%_pb2_grpc.py: proto/fs3/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

fs3/proto/fs3/%.proto: proto/fs3/%.proto
	@mkdir -p $(@D)
	cp $< $@

run: install
	@mkdir -p mnt
	$(BIN)/fs3 local up --dir .fs3 --mount ./mnt

test: install
	$(BIN)/ruff check fs3 hfreduce haiscale cluster_model hai tests bench
	$(BIN)/mypy fs3 hfreduce haiscale cluster_model hai bench tests
	$(BIN)/lint-imports
	$(BIN)/pytest $(PYTEST_ARGS)

# The edit loop's quick tier (about a minute): the same lint, types and import contracts, the tests not
# marked slow (those start clusters, mounts, processes or simulator seeds) and 25 simulator seeds.
check: install
	$(BIN)/ruff check fs3 hfreduce haiscale cluster_model hai tests bench
	$(BIN)/mypy fs3 hfreduce haiscale cluster_model hai bench tests
	$(BIN)/lint-imports
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)
	$(PY) -m fs3.sim --seeds 25 --no-record

lint: install
	$(BIN)/ruff check fs3 hfreduce haiscale cluster_model hai tests bench
	$(BIN)/mypy fs3 hfreduce haiscale cluster_model hai bench tests
	$(BIN)/lint-imports

# The wheel as a user installs it (a few minutes; reruns reuse pip's cache): sdist and wheel built by
# `python -m build` from a copy without generated modules, installed into a fresh venv, then from /tmp
# `fs3 local up`, the client, a FUSE mount and `fs3 local down` (scripts/test_wheel.sh).
test-wheel:
	./scripts/test_wheel.sh

# Long deterministic-simulation sweep on every core (JOBS=N to limit): `make sim SEEDS=10000`.
# Resumes: seeds already in bench/results/sim/<config>.jsonl are skipped; summary-<config>.md is refreshed.
sim: install
	$(PY) -m fs3.sim --resume --first $(FIRST) --seeds $(SEEDS) $(if $(JOBS),--jobs $(JOBS))

# The metadata service in the simulator (several clients, lost replies, meta restarts, lease lapses,
# histories checked against the namespace model), then the in-process model test with every fault:
# `make sim-meta SEEDS=2000 MODEL_EXAMPLES=1000`. Fails while either finds a failure.
sim-meta: install
	@status=0; \
	$(PY) -m fs3.sim --mix meta --resume --first $(FIRST) --seeds $(SEEDS) $(if $(JOBS),--jobs $(JOBS)) || status=1; \
	FS3_META_MODEL_EXAMPLES=$(MODEL_EXAMPLES) $(BIN)/pytest -q -p no:cacheprovider tests/test_meta_model.py \
		-k every_fault || status=1; \
	exit $$status

# Three meta servers on one PostgreSQL database, concurrent clients on different servers, lost
# replies retried elsewhere and a server stopped, histories checked for linearizability; `make test`
# runs 3 seeds, this many more: `make meta-linearizable LIN_SEEDS=50 LIN_OPS=60`.
meta-linearizable: install
	FS3_META_LINEARIZABLE_SEEDS=$(LIN_SEEDS) FS3_META_LINEARIZABLE_OPS=$(LIN_OPS) $(BIN)/pytest -q -p no:cacheprovider \
		tests/test_meta_linearizable_pg.py

# Metadata backups under load with real processes: backups beside a running meta (RocksDB),
# restore into an empty store, every file byte for byte (docs/operations.md).
meta-backup: install
	FS3_META_BACKUP_SCENARIO=1 FS3_META_BACKUP_FILES=$${FS3_META_BACKUP_FILES:-200} $(BIN)/pytest -q \
		tests/test_meta_dump_process.py

# The randomized single-file exerciser, long, on the FUSE mount and the client library:
# `make fsx FSX_SEEDS=1000 FSX_OPS=150` (FSX_FIRST=N to start elsewhere). A failure prints the seed and
# a shrunk operation list; FS3_FSX_REPLAY='...' replays it.
fsx: install
	FS3_FSX_SEEDS=$(FSX_SEEDS) FS3_FSX_OPS=$(FSX_OPS) FS3_FSX_FIRST=$(FSX_FIRST) $(BIN)/pytest -q tests/test_fsx.py

# fs3 against GlusterFS, MooseFS and the local directory (root; installs the peers with apt):
# fio, small files, the juicefs-bench flow; table in bench/results/peers-*.{md,json,png}.
bench: install
	$(PY) bench/compare.py

bench-quick: install
	$(PY) bench/compare.py --quick

# The replication path alone: chunk writes and reads against the storage service.
bench-chunk: install
	$(PY) bench/chunk_bench.py

# Metadata ops/s (1 and 16 clients) and 1 GiB file throughput, each next to a local directory; then
# 16 clients on one meta over RocksDB against 1, 2 and 3 meta servers over PostgreSQL (round trips per
# operation, CPU of meta, database and clients): bench/results/meta-scale-*.json.
bench-meta: install
	$(PY) bench/meta_bench.py
	$(PY) bench/meta_scale_bench.py

bench-file: install
	$(PY) bench/file_bench.py

# Fault scenarios on a cluster of network-namespace hosts (root); report in bench/results/chaos-*.{md,json,png}.
chaos: install
	$(PY) -m tests.chaos.run

# The previous release's cluster upgraded to this code one node at a time under load (root).
rolling-upgrade: install
	$(PY) -m tests.chaos.rolling_upgrade

# fio on the FUSE mount next to a local directory.
bench-fuse: install
	$(PY) bench/fuse_bench.py

# fs3.usrbio (shared-memory rings) against the FUSE mount (4 KiB random reads, 4 processes, batches of 64)
# and against the local directory (128 KiB records, cold): median ratios of 3 interleaved rounds,
# bench/results/usrbio-*.json. `make bench-usrbio BENCH_USRBIO_ARGS=--quick` for a shorter run.
bench-usrbio: install
	$(PY) bench/usrbio_bench.py $(BENCH_USRBIO_ARGS)
# The mount with one process against the same mount with data workers (--workers 3), interleaved.
bench-fuse-workers: install
	$(PY) bench/fuse_workers_bench.py

# HFReduce's allreduce against torch's gloo in the same ranks (1 node x 2 and x 4 ranks; 2 and 3 network-
# namespace nodes x 2, root), and against the memory-bandwidth ceiling measured in the same run:
# bench/results/hfreduce-*.{md,json,png} and the model's input bench/results/hfreduce.json.
bench-hfreduce: install
	$(PY) bench/hfreduce_bench.py

# HaiScale against its baselines, each in one run: DDP step time against torch's DDP on gloo (1 node x 4
# ranks, 2 network-namespace nodes x 2, root), checkpoint save/load against torch.save on the FUSE mount,
# locally and DCP on fs3://, RecordDataset samples/s against the FUSE mount and local disk, read_many
# against one read per record: bench/results/haiscale-*.{md,json} and the lines each prints.
bench-haiscale: install
	$(PY) bench/haiscale_ddp_bench.py
	$(PY) bench/haiscale_checkpoint_bench.py
	$(PY) bench/haiscale_data_bench.py
	$(PY) bench/read_many_bench.py

# The HAI scheduler's rules against strict FIFO on one seeded synthetic trace, in virtual time (seconds
# to run): occupancy, waits per priority, suspensions; then the suspend path on real processes (hai local:
# fs3, the server, two agents; about 30 s): suspend request to free nodes as a ratio to the grace, for a
# job that acknowledges and one that ignores it. `make bench-hai BENCH_HAI_ARGS="--jobs 500 --no-real"`.
bench-hai: install
	$(PY) bench/hai_bench.py $(BENCH_HAI_ARGS)

# The whole training path on a local fs3 cluster: the standard library's source as records on fs3,
# the byte-level GPT trained with HaiScale DDP on 4 ranks, a rank killed and the job resumed from its
# fs3 checkpoint, bit-identical to an uninterrupted run (a few minutes).
train-demo: install
	$(PY) -m haiscale.examples.demo

# The HAI Platform's long scenario, narrated: time-sharing, a killed node, an ignored suspend, each
# ending bit-identical to the uninterrupted run (scripts/hai_demo.py; a few minutes); then the
# ignored suspend's end-to-end test with all its checks (tests/test_hai_ignored_suspend.py).
hai-demo: install
	$(PY) scripts/hai_demo.py
	FS3_HAI_LONG=1 $(BIN)/pytest -q -p no:cacheprovider tests/test_hai_ignored_suspend.py

# Scrubbing under load: bytes flipped on random replicas of many chunks while a writer runs; every
# copy repaired by the background scrubbers (docs/operations.md, "Scrubbing").
SCRUB_DEMO_CHUNKS ?= 300
scrub-demo: install
	FS3_SCRUB_DEMO_CHUNKS=$(SCRUB_DEMO_CHUNKS) $(BIN)/pytest -q -s -p no:cacheprovider tests/test_scrub.py -k demo

# Adding and draining storage under foreground I/O: a rebalance onto new nodes at a resync rate, a
# drain whose receiving node is killed mid-sync; prints foreground throughput / idle for each
# (docs/operations.md, "Adding, draining and replacing storage"; about a minute).
DRAIN_DEMO_RATE ?= 1048576
drain-demo: install
	FS3_DRAIN_DEMO_RATE=$(DRAIN_DEMO_RATE) $(PY) scripts/drain_demo.py

# HaiScale's longer multi-rank tests (the contiguous 4-rank pipeline, a stopped rank's neighbour timing out,
# FSDP state resharded onto three ranks, a dead FSDP peer, FSDP and the pipeline on two network-namespace
# nodes) with the rest of HaiScale's tests.
test-haiscale-long: install
	HAISCALE_LONG=1 $(BIN)/pytest -q tests/test_haiscale_pipeline.py tests/test_haiscale_fsdp.py \
		tests/test_haiscale_train.py

# The trash against its model, long: TRASH_SEEDS seeds of TRASH_STEPS random create/rm/restore/purge/
# expire steps each (make test runs three short seeds).
TRASH_SEEDS ?= 40
TRASH_STEPS ?= 400
trash-long: install
	FS3_TRASH_SEEDS=$(TRASH_SEEDS) FS3_TRASH_STEPS=$(TRASH_STEPS) $(BIN)/pytest -q -p no:cacheprovider \
		tests/test_trash.py -k long

# Quotas at length: the random exerciser against its model on many seeds and longer runs, and
# the client on an in-process cluster (QUOTA_RACES rounds of two clients writing into one quota
# at once) and a FUSE mount (tests/test_quota_cluster.py, _mount.py).
QUOTA_SEEDS ?= 40
QUOTA_STEPS ?= 400
QUOTA_RACES ?= 8
quota-long: install
	FS3_QUOTA_SEEDS=$(QUOTA_SEEDS) FS3_QUOTA_STEPS=$(QUOTA_STEPS) FS3_QUOTA_RACES=$(QUOTA_RACES) \
		$(BIN)/pytest -q -p no:cacheprovider \
		tests/test_quota.py tests/test_quota_cluster.py tests/test_quota_mount.py

# The Fire-Flyer 2 model against the paper: bench/results/cluster_model/report.md and its plots.
model-report: install
	$(PY) -m cluster_model report --out bench/results/cluster_model

clean:
	rm -rf $(VENV) fs3/*_pb2.py fs3/*_pb2.pyi fs3/*_pb2_grpc.py fs3/proto .pytest_cache .mypy_cache .ruff_cache
