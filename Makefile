.PHONY: install test lint format selfcheck train

install:
	pip install "torch==2.13.0" -e ".[test]"

test:
	python -m pytest -q

lint:
	ruff check . && ruff format --check .

format:
	ruff check --fix . && ruff format .

selfcheck:
	fasttnt selfcheck

train:
	fasttnt train
