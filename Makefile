# The verbs a newcomer uses. `make serve` and `make test` set up everything they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
GPU    ?= 0
EXTRA  := $(if $(filter 1,$(GPU)),gpu,cpu)
# paddlepaddle-gpu 2.6 reads only legacy programs (inference.pdmodel)
EXPORT_FLAGS := $(if $(filter 1,$(GPU)),--legacy)
MODELS ?= models
CERTS  ?= certs
ARGS   ?=
# `make test` runs the suite in this many processes, a file to each (0: in this one): one more
# than the 2 cores it is made for, as most tests wait on servers (docs/development.md).
TEST_WORKERS ?= 3
DOCKER ?= docker
IMAGE  ?= paddlequic:cpu

PROTO_SRC := $(shell find protos -name '*.proto')
STAMP_INSTALL := $(VENV)/.installed-$(EXTRA)
STAMP_PROTO := protos/.generated
STAMP_MODELS := $(MODELS)/.exported

.PHONY: help setup proto models models-bench certs serve test test-avx2 lint image image-check bench bench-transport bench-scale bench-scale-kit bench-peers bench-http bench-rtt bench-observability bench-generate bench-sequences bench-density bench-worker-loop lab-replicas lab-udp-fallback lab-migration chaos mutate clean

help:
	@echo "make serve   set up .venv, generate protobuf code, export example models, start the server"
	@echo "make test    run the test suite (no GPU needed; TEST_WORKERS=0 runs it in one process)"
	@echo "make test-avx2  the tests that compare floats across batch sizes, with AVX2 kernels forced"
	@echo "make lint    ruff + mypy + the import layering (import-linter)"
	@echo "make mutate  mutation testing of the security and data-integrity modules, surviving mutants per module"
	@echo "             (unit tests only; at most 25 mutants per module, a fixed sample: ARGS='--cap 0' for all,"
	@echo "             ARGS='--only poison,credit' for some, ARGS='--module PATH=TEST,...' for one not listed;"
	@echo "             about 45 min on 2 shared cores; writes bench-results/)"
	@echo "make chaos   abuse suite: attacks on a live server while good clients call (writes bench-results/)"
	@echo "make bench   served vs the raw predictor, batching on/off (resnet18, mlp_wide), and tensors in shared memory vs raw (writes bench-results/)"
	@echo "make bench-transport  HTTP/3 vs HTTP/2 in alternating rounds: requests/s, CPU per call and per new connection (writes bench-results/)"
	@echo "make bench-scale  --frontends 1, 2, 4 in 3 alternating rounds: ModelInfer and ModelStreamInfer requests/s, new connections/s and CPU per call on both transports, as ratios (writes bench-results/)"
	@echo "make bench-peers  paddlequic vs a plain grpcio server, MLServer (batching on/off; .venv-mlserver, made when missing) and a canned-answer ceiling (writes bench-results/)"
	@echo "make bench-http  REST (JSON, binary tensors) vs its own gRPC, MLServer's REST (.venv-mlserver) and FastAPI on uvicorn; generate_stream (SSE) vs gRPC streaming, CPU per token (writes bench-results/)"
	@echo "make bench-scale-kit  wheels (.whl/) to run bench-scale on a many-core host without network or Paddle (scripts/bench_scale_host.sh)"
	@echo "make bench-observability  cost of metrics + 1% tracing vs off (writes bench-results/)"
	@echo "make bench-generate  streaming generation: one at a time vs request- vs iteration-level batching, engine-only and served, h3 vs h2 (writes bench-results/)"
	@echo "make bench-sequences  the stateful kws example at 1, 16, 64 live sequences vs its engine alone (writes bench-results/)"
	@echo "make bench-density  10, 50, 200 copies of mlp and the examples: READY time, worker USS, total PSS, preloaded vs fresh workers; resnet18 x 4 with and without a model template (writes bench-results/)"
	@echo "make bench-worker-loop  a worker batching from its own queues: CPU per batch of its loop and of the caller's records against the predictor's own, batches of 1, 8, 32 (writes bench-results/)"
	@echo "make bench-rtt  new connection to first response over an emulated slow link, h2+TLS vs h3 (root)"
	@echo "make lab-replicas  two replicas sharing a Redis ticket store in network namespaces (root)"
	@echo "make lab-udp-fallback  an auto:// client on a link that drops UDP, then lets it through (root)"
	@echo "make lab-migration  calls across client address changes (NAT rebinding, a move), --frontends 1 and 2 (root; writes bench-results/)"
	@echo "make setup [GPU=1]  install into .venv (GPU=1: paddlepaddle-gpu)"
	@echo "make models  export the example model repository into $(MODELS)/"
	@echo "make certs   create a development CA and server certificate in $(CERTS)/"
	@echo "make image   build the CPU image $(IMAGE) (a Docker engine with BuildKit; see docs/operations.md)"
	@echo "make image-check  build it, run it on $(MODELS)/ (read-only) and check health and inference on both transports"

$(BIN)/python:
	@echo "==> creating $(VENV)"
	$(PYTHON) -m venv $(VENV)

$(STAMP_INSTALL): pyproject.toml setup.py | $(BIN)/python
	@echo "==> installing paddlequic[$(EXTRA),dev] into $(VENV) (first time: a minute or two)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRA),dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

setup: $(STAMP_INSTALL) $(STAMP_PROTO)

# The build step every pip install runs (setup.py), again when a .proto changed.
$(STAMP_PROTO): $(PROTO_SRC) setup.py $(STAMP_INSTALL)
	@echo "==> generating protobuf code"
	$(BIN)/python setup.py -q build_protos
	@touch $@

proto: $(STAMP_PROTO)

$(STAMP_MODELS): scripts/export_models.py $(shell find examples -type f) $(STAMP_INSTALL)
	@echo "==> exporting example models into $(MODELS)/ (random weights, real architectures)"
	$(BIN)/python scripts/export_models.py --out $(MODELS) $(EXPORT_FLAGS)
	@touch $@

models: $(STAMP_MODELS)

$(CERTS)/server.pem: $(STAMP_INSTALL)
	@echo "==> creating development certificates in $(CERTS)/"
	$(BIN)/paddlequic certs --dir $(CERTS)

certs: $(CERTS)/server.pem

serve: setup models certs
	$(BIN)/paddlequic serve --model-repository $(MODELS) --certs-dir $(CERTS) $(ARGS)

# Every server, front-end and worker process the tests start imports the project's modules:
# compiled once here, each loads their bytecode (PYTHONDONTWRITEBYTECODE, which some hosts set,
# stops Python from writing it, not from reading it). Not the model repository's: a model's
# files stay as they were deployed.
BYTECODE = $(BIN)/python -m compileall -q service transport oip clients protos >/dev/null

test: setup models
	$(BYTECODE)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# The tests that compare floats across batch sizes, with the AVX2 kernels an AVX-512 host would
# not pick (docs/development.md, "Floats on any x86-64 CPU"); .ci/run runs it after make test.
test-avx2: setup models
	$(BYTECODE)
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
		$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m float_kernels $(ARGS)

models-bench: models
	$(BIN)/python scripts/export_models.py --out $(MODELS) --only mlp_wide $(EXPORT_FLAGS)

bench: setup models-bench
	$(BIN)/python -m scripts.bench_batching $(ARGS)
	$(BIN)/python -m scripts.bench_shared_memory
	$(BIN)/python -m scripts.bench_shared_memory_frontends

bench-transport: setup models
	$(BIN)/python -m scripts.bench_transport $(ARGS)

bench-scale: setup models
	$(BIN)/python -m scripts.bench_scale $(ARGS)

# MLServer for bench-peers, in a venv of its own (its dependencies are not paddlequic's), with
# the Paddle of pyproject's cpu extra and the protobuf the generated code needs. uvloop < 0.22:
# MLServer 1.7.1's workers call asyncio.get_event_loop() with no loop, which newer uvloop refuses.
PADDLE_PIN := $(shell sed -n 's/^cpu = .*"\(paddlepaddle==[^"]*\)".*/\1/p' pyproject.toml)
MLSERVER_VENV := .venv-mlserver

$(MLSERVER_VENV)/bin/mlserver:
	@echo "==> creating $(MLSERVER_VENV) (MLServer 1.7.1, $(PADDLE_PIN); first time: a minute or two)"
	$(PYTHON) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/python -m pip install -q "mlserver==1.7.1" "$(PADDLE_PIN)" \
		"protobuf>=6.33.5,<7" "uvloop<0.22"

bench-peers: setup models-bench $(MLSERVER_VENV)/bin/mlserver
	$(BIN)/python -m scripts.bench_peers $(ARGS)

bench-http: setup models $(MLSERVER_VENV)/bin/mlserver
	$(BIN)/python -m scripts.bench_http $(ARGS)

# For a many-core host without network or Paddle: docs/benchmarks.md, "On a many-core host".
bench-scale-kit: setup
	$(BIN)/python -m scripts.bench_scale_kit $(ARGS)

bench-observability: setup models
	$(BIN)/python -m scripts.bench_observability $(ARGS)

bench-generate: setup models
	$(BIN)/python -m scripts.bench_generate $(ARGS)

bench-sequences: setup models
	$(BIN)/python -m scripts.bench_sequences $(ARGS)

bench-worker-loop: setup models
	$(BIN)/python -m scripts.bench_worker_loop $(ARGS)

bench-density: setup models
	$(BIN)/python -m scripts.bench_density $(ARGS)

bench-rtt: setup models
	$(BIN)/python -m scripts.rtt_lab $(ARGS)

lab-replicas: setup models
	$(BIN)/python -m scripts.replica_lab

lab-udp-fallback: setup models
	$(BIN)/python -m scripts.udp_fallback_lab

lab-migration: setup models
	$(BIN)/python -m scripts.migration_lab $(ARGS)

chaos: setup models
	$(BIN)/python -m tests.chaos $(ARGS)

# Not part of `make test` (minutes): docs/development.md, "Mutation testing".
mutate: setup
	$(BIN)/python -m scripts.mutate $(ARGS)

# Not part of `make test` (minutes, and a Docker engine). DOCKER_BUILD_FLAGS (e.g. --network
# host) go to docker build; ARGS (e.g. --network host) to the check.
image:
	DOCKER=$(DOCKER) IMAGE=$(IMAGE) deploy/docker/build_image.sh

image-check: image setup models
	$(BIN)/python -m scripts.image_check --docker $(DOCKER) --image $(IMAGE) --models $(MODELS) $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) $(MLSERVER_VENV) $(MODELS) $(STAMP_PROTO) .pytest_cache .mypy_cache
	find protos -name '*_pb2*.py*' -delete
