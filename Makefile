# The two commands in the README: `make tune` (main job) and `make test` (whole suite).
.PHONY: tune test setup setup-test
OUT ?= out/tune

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

tune: setup
	.venv/bin/kvtune tune --out $(OUT)

test: setup-test
	.venv/bin/python -m pytest -q -p no:cacheprovider tests
