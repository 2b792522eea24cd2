.PHONY: install test sweep lint format selfcheck train

install:
	pip install "torch==2.13.0" -e ".[test]"

test:
	python -m pytest -q

# every seed that fails: the kernel tests at 200 seeds, the tests that train at 20 (about an hour on 2 cores)
sweep:
	python tests/support/sweep_seeds.py --out sweep.json

lint:
	ruff check . && ruff format --check .

format:
	ruff check --fix . && ruff format .

selfcheck:
	fasttnt selfcheck

train:
	fasttnt train
