# The two commands in the README: `make tune` (main job) and `make test` (whole suite).
.PHONY: tune test lint setup setup-test test-vllm033
OUT ?= out/tune
# In-process connector suite (real NIXL agents, no engines): run on every supported vLLM release.
CONNECTOR_TESTS = tests/test_connectors_scheduler.py tests/test_connectors_unit.py \
	tests/test_connectors_nixl.py

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

tune: setup
	.venv/bin/kvtune tune --out $(OUT) --fabric auto --verify

# The linter first (rules in pyproject.toml's [tool.ruff]: a lint error fails the suite), then the
# whole suite on .venv's vLLM (0.32.0 on CPU machines), then the connector suite on 0.33.0.
# Each run prints "kvtune connector suite on vLLM X: N passed, ...".
test: setup-test lint
	.venv/bin/python -m pytest -q -p no:cacheprovider tests
	$(MAKE) --no-print-directory test-vllm033

LINT_PATHS = kvtune tests bench scripts
lint: setup-test
	.venv/bin/ruff check $(LINT_PATHS)

# vLLM 0.33.0's own Python (.venv-vllm033, made by setup.sh --test). VLLM_TARGET_DEVICE=cpu picks
# vLLM's CPU platform (vllm/platforms/__init__.py); without it 0.33 fails "Failed to infer device
# type" on a machine without an accelerator. KVTUNE_EXPECT_VLLM makes the run fail unless it
# imported that release and ran the whole connector suite (tests/conftest.py).
test-vllm033: setup-test
	VLLM_TARGET_DEVICE=cpu KVTUNE_EXPECT_VLLM=0.33.0 .venv-vllm033/bin/python -m pytest -q \
		-p no:cacheprovider $(CONNECTOR_TESTS)
