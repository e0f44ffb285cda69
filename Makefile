# tiered_kv: two commands do everything on a fresh machine.
#   make demo   set up .venv (torch CPU + tiered_kv) and run the demo
#   make test   set up .venv (+ vLLM 0.32) and .venv-sglang (+ SGLang 0.5.23) and run every test suite
SHELL := /bin/bash
.ONESHELL:
.PHONY: demo test test-core test-sglang setup bench gpu-test docs clean

demo:
	scripts/setup_venvs.sh core
	.venv/bin/tiered-kv demo

setup:
	scripts/setup_venvs.sh all

# Everything but the SGLang tests runs in .venv (vLLM 0.32); the SGLang tests run in .venv-sglang.
test: setup
	scripts/run_tests.sh

test-core:
	scripts/setup_venvs.sh core
	.venv/bin/python -m pytest -q tests/values tests/planner tests/copy tests/tiers tests/store

bench:
	scripts/setup_venvs.sh core
	.venv/bin/python benchmarks/disk_bench.py

# The generated tables: config keys (from the config dataclasses) and results (from docs/results/*.json).
docs:
	scripts/setup_venvs.sh core
	.venv/bin/python scripts/config_docs.py
	.venv/bin/python benchmarks/report_page.py

clean:
	rm -rf .venv .venv-sglang .pytest_cache
