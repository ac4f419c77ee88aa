# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
# Where the project keeps its local files (config/settings.py reads the same variable).
VAR_DIR := $(or $(B3OS_VAR_DIR),var)
LLAMA_CPP_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)
# The Codex CLI release the tests drive against a live server (tests/inference/test_responses_clients.py).
CODEX_VERSION := 0.171.0
CODEX_DIR := var/codex
# The openai Node SDK release the tests drive (tests/inference/test_node_sdk.py).
OPENAI_NODE_VERSION := 7.60.0
NODE_CLIENTS_DIR := var/node-clients

.PHONY: run test lint install install-test rebuild-runner system-test-deps codex-cli node-clients bench soak clean

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Python 3.11 or later is needed: make $(MAKECMDGOALS) PYTHON=python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# pip does not byte-compile what it installs (PyTorch, transformers and sympy alone: half a minute of a fresh install
# on two cores). Python compiles a module the first time a process imports it and keeps it: only the modules used,
# once, the project's own included. A PYTHONDONTWRITEBYTECODE from the caller's environment would have every process
# compile them again (every server and worker the tests start: about 0.4 s each for the project's alone).
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL := $(PY) -m pip install -q --no-compile

# Reinstall only when the project's dependencies change. The CPU runner's engine is built by
# scripts/build-cpu-runner for a portable x86-64 baseline, before pip could take another build.
$(VENV)/.installed: pyproject.toml scripts/build-cpu-runner | $(PY)
	scripts/build-cpu-runner $(PY) $(LLAMA_CPP_VERSION)
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml scripts/build-cpu-runner | $(PY)
	scripts/build-cpu-runner $(PY) $(LLAMA_CPP_VERSION)
	$(PIP_INSTALL) -e ".[test]"
	touch $(VENV)/.installed $@

# The runner's engine is looked at every time too: a checkout whose machine changed (a CPU without AVX2) gets the
# wheel built for the CPU under it. The script returns at once when the installed wheel is already that one.
install: $(VENV)/.installed
	@scripts/build-cpu-runner $(PY) $(LLAMA_CPP_VERSION)

install-test: $(VENV)/.installed-test
	@scripts/build-cpu-runner $(PY) $(LLAMA_CPP_VERSION)

# Compiles the CPU runner's engine again, whatever is cached (after a compiler or CPU change).
rebuild-runner: | $(PY)
	scripts/build-cpu-runner $(PY) $(LLAMA_CPP_VERSION) --rebuild

run: install
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py bootstrap_demo
	$(PY) manage.py create_demo_instance demo > $(VAR_DIR)/demo-instance
	@echo "Agent:    $$(cat $(VAR_DIR)/demo-instance)  (X-Tenant-ID: demo, POST http://$(HOST):$(PORT)/v1/responses)"
	@echo "Models:   curl -s http://$(HOST):$(PORT)/v1/infer/models -H \"Authorization: Bearer $$(cat $(VAR_DIR)/demo-api-key)\""
	@echo "Admin:    http://$(HOST):$(PORT)/admin/"
	$(PY) manage.py serve --host $(HOST) --port $(PORT)

# Servers and the browser the tests drive, from Debian's packages (PostgreSQL only for its server programs;
# HAProxy is deploy/Procfile's load balancer).
system-test-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v haproxy >/dev/null || missing="$$missing haproxy"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	if [ -n "$$missing" ]; then \
		echo "Installing$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# Into the project's var/ only, never globally; once per pinned version (about 400 MB installed).
$(CODEX_DIR)/.installed-$(CODEX_VERSION):
	@command -v npm >/dev/null || { echo "npm (Node.js 20 or later) is needed for the Codex CLI the tests run" >&2; exit 1; }
	@echo "Installing the Codex CLI $(CODEX_VERSION) into $(CODEX_DIR)"
	rm -f $(CODEX_DIR)/.installed-*
	npm install --prefix $(CODEX_DIR) --no-save --no-audit --no-fund --loglevel=error @openai/codex@$(CODEX_VERSION)
	touch $@

codex-cli: $(CODEX_DIR)/.installed-$(CODEX_VERSION)

# The openai Node SDK the tests drive as the API reference's TypeScript examples do (tests/inference/test_node_sdk.py).
$(NODE_CLIENTS_DIR)/.installed-$(OPENAI_NODE_VERSION):
	@command -v npm >/dev/null || { echo "npm (Node.js 20 or later) is needed for the openai Node SDK the tests run" >&2; exit 1; }
	rm -f $(NODE_CLIENTS_DIR)/.installed-*
	npm install --prefix $(NODE_CLIENTS_DIR) --no-save --no-audit --no-fund --loglevel=error openai@$(OPENAI_NODE_VERSION)
	touch $@

node-clients: $(NODE_CLIENTS_DIR)/.installed-$(OPENAI_NODE_VERSION)

# Lint (with import order) and type checks come first: they take seconds, the suite minutes. mypy reads the
# checkout and every library's types, about 50 s on two cores when it starts cold, as in every fresh clone; its cache
# is kept beside the runner's wheels, one per checkout's path, where a later clone at the same path finds it (mypy
# checks each file's contents, not only its time, so a file changed since is read again).
MYPY_CACHE ?= $(HOME)/.cache/b3os/mypy/$(shell pwd | sha256sum | cut -c1-12)
lint: install-test
	$(PY) -m ruff check .
	$(PY) -m mypy --cache-dir $(MYPY_CACHE)

# The whole suite on SQLite (the default database), its test files spread over TEST_PROCESSES processes, and beside
# it the tests marked database on a throwaway PostgreSQL cluster. Much of the suite waits on processes and clocks (live
# servers starting, outages, deadlines), so the processes fill each other's idle time; each runs the model on one
# thread, so that together they do not ask for more cores than there are. The PostgreSQL stage runs at a lower
# priority; its report follows the SQLite stage's.
TEST_PROCESSES ?= 2
test: lint system-test-deps codex-cli node-clients
	@mkdir -p $(VAR_DIR)
	@CPU_RUNNER_THREADS=1 nice -n 10 $(PY) -m pytest -p tests.postgres -m database -p no:cacheprovider > $(VAR_DIR)/test-postgres.log 2>&1 & \
	postgres=$$!; \
	CPU_RUNNER_THREADS=1 $(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile; sqlite=$$?; \
	wait $$postgres; pg=$$?; \
	echo "== The tests marked database, on PostgreSQL (-p tests.postgres -m database) =="; \
	cat $(VAR_DIR)/test-postgres.log; \
	test $$sqlite -eq 0 && test $$pg -eq 0

$(VENV)/.installed-bench: pyproject.toml | $(VENV)/.installed-test
	$(PIP_INSTALL) -e ".[test,bench]"
	touch $@

bench: install-test $(VENV)/.installed-bench system-test-deps
	$(PY) bench/cpu_build.py
	$(PY) bench/omp_teams.py
	$(PY) bench/runner_throughput.py
	$(PY) bench/admission_overhead.py
	$(PY) bench/gateway_overhead.py
	$(PY) bench/scale_out.py
	$(PY) bench/connections.py

# Ten minutes of mixed traffic against deploy/'s topology (SOAK_SECONDS to change it).
SOAK_SECONDS ?= 600
soak: install-test system-test-deps
	$(PY) bench/soak.py --duration $(SOAK_SECONDS)

clean:
	rm -rf $(VENV) var
