# Two entry points do all setup on a fresh machine (root, apt + PyPI):
#   make run    build, then `infinity train` on its built-in default
#   make test   build, then the test suite
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# The local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP := build/.deps-stamp

.PHONY: deps build run test test-fast asan native-test clean

$(STAMP): setup.py pyproject.toml native/install_deps.sh Makefile
	bash native/install_deps.sh
	$(PIP) install -q --disable-pip-version-check "$(TORCH_PIN)" numpy pytest "pytest-xdist==3.8.0" hypothesis pybind11 setuptools wheel matplotlib "transformers==5.24.0" "peft==0.21.2" "accelerate==1.16.0" "datasets==5.2.0" "trl==1.16.0" "lightning==2.6.6" "tensorboard==2.21.0" tqdm safetensors "zarr>=3,<4"
	mkdir -p build && touch $(STAMP)

deps: $(STAMP)

NATIVE_SRC := $(shell find native -name '*.cpp' -o -name '*.hpp' -o -name '*.inl' -o -name '*.h' | grep -v '^native/tests/')
BUILD_STAMP := build/.native-stamp

# An editable install: the extension lands in infinity/ and `infinity` goes on PATH.
$(BUILD_STAMP): $(STAMP) $(NATIVE_SRC) setup.py
	$(PIP) install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $(BUILD_STAMP)

build: $(BUILD_STAMP)

# The main job: `infinity train` on its default (a 3.3M-parameter GPT, parameters and optimizer on NVMe
# swap files in a temp dir, 60 steps: half a minute on 2 AVX-512 cores, about 4 minutes where there is only
# AVX2); metrics and a plot land in runs/.
run: build
	$(PYTHON) -m infinity train

# One pytest worker per core (xdist): most tests wait on subprocesses, the disk or other ranks.
test: build
	$(PYTHON) -m pytest -q -n auto --dist worksteal tests

# The fast tier (about 2 minutes): every test but those marked slow.
test-fast: build
	$(PYTHON) -m pytest -q -n auto --dist worksteal -m "not slow" tests

# The native tests (a C++ driver, no Python) under ASan + UBSan.
asan: deps
	$(MAKE) -C native/tests SANITIZE=address,undefined run

native-test: deps
	$(MAKE) -C native/tests run

clean:
	rm -rf build *.egg-info infinity/*.so native/tests/build
