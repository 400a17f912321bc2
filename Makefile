# The README's two set-up commands: `make demo` and `make test`. Both create .venv in the repository root if missing.
# `make demo` installs what `rapidspec demo` needs and runs it; `make test` installs the rest (the extras, llama.cpp's
# llama-server, Debian's Chromium) and runs the tests. scripts/install.py does the steps: one line each on the
# terminal (what, about how long), their output in .venv/setup.log. Each set-up has its stamp: `make test` after
# `make demo` adds only what is missing, `make demo` after `make test` installs nothing.
# `make vllm` makes .venv-vllm: vLLM for CPUs (it pins packages .venv is ahead of) with rapidspec and what RAPID's
# proposer imports (docs/vllm.md); `make test` makes it too, for the tests that run vLLM.
VENV := .venv
PY := $(VENV)/bin/python
SETUP := python3 scripts/install.py --venv $(VENV)
SETUP_FILES := pyproject.toml Makefile scripts/install.py
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
VLLM_VENV := .venv-vllm
# the vLLM release is pinned in rapidspec/vllm/environment.py
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test install install-demo vllm

install-demo: $(DEMO_STAMP)
install: $(TEST_STAMP) $(VLLM_STAMP)
vllm: $(VLLM_STAMP)

$(DEMO_STAMP): $(SETUP_FILES)
	@$(SETUP) demo
	@touch $@

$(TEST_STAMP): $(DEMO_STAMP) $(SETUP_FILES)
	@$(SETUP) test
	@touch $@

$(VLLM_STAMP): $(SETUP_FILES) rapidspec/vllm/environment.py
	@python3 scripts/install.py --venv $(VLLM_VENV) vllm
	@touch $@

demo: $(DEMO_STAMP)
	$(VENV)/bin/rapidspec demo

# vLLM's set-up after the others: the llama-cpp-python wheel the demo's set-up compiled is then in pip's cache
test: $(TEST_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -ra
