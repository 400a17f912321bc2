# The README's two set-up commands: `make demo` and `make test`. Both create .venv in the repository root if missing.
# `make demo` installs what `rapidspec demo` needs and runs it; `make test` installs the rest (the extras, llama.cpp's
# llama-server, Debian's Chromium) and runs the tests. scripts/install.py does the steps: one line each on the
# terminal (what, about how long), their output in .venv/setup.log. Each set-up has its stamp: `make test` after
# `make demo` adds only what is missing, `make demo` after `make test` installs nothing.
# llama.cpp is compiled once per machine, version and CPU, in the rapidspec cache (llama.cpp/<version>-<cpu>/,
# rapidspec/bench/llama_cpp_tree.py): `make demo` compiles llama-cpp-python's wheel there and keeps it (a fresh
# clone on this machine installs it without compiling), `make test` builds llama-server in the same build folder.
# `make vllm` makes .venv-vllm: vLLM for CPUs (it pins packages .venv is ahead of) with rapidspec and what RAPID's
# proposer imports (docs/vllm.md); `make test` makes it too, for the tests that run vLLM, while llama-server compiles.
# `make test-fast` runs the tests that need no real model, no vLLM and no browser (the loop while changing code);
# `make test` runs them all and prints the suite's total and its 10 slowest tests.
VENV := .venv
PY := $(VENV)/bin/python
SETUP := python3 scripts/install.py --venv $(VENV)
SETUP_FILES := pyproject.toml Makefile scripts/install.py
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
VLLM_VENV := .venv-vllm
# the vLLM release is pinned in rapidspec/vllm/environment.py
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-fast install install-demo vllm

install-demo: $(DEMO_STAMP)
install: $(TEST_STAMP)
vllm: $(VLLM_STAMP)

$(DEMO_STAMP): $(SETUP_FILES)
	@$(SETUP) demo
	@touch $@

$(TEST_STAMP): $(DEMO_STAMP) $(SETUP_FILES) rapidspec/bench/llama_cpp_tree.py rapidspec/vllm/environment.py
	@$(SETUP) test --vllm-venv $(VLLM_VENV)
	@touch $(VLLM_STAMP) $@

$(VLLM_STAMP): $(SETUP_FILES) rapidspec/vllm/environment.py rapidspec/bench/llama_cpp_tree.py
	@python3 scripts/install.py --venv $(VLLM_VENV) vllm
	@touch $@

demo: $(DEMO_STAMP)
	$(VENV)/bin/rapidspec demo

# one pytest-xdist worker per CPU, each computing on one thread (tests/conftest.py); loadgroup: one worker runs vLLM;
# --no-loadscope-reorder: the long work first, as tests/conftest.py orders it; Python keeps its compiled modules and
# pytest its rewritten ones where the environment says not to (PYTHONDONTWRITEBYTECODE): a collection took 11 s, not 21
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -ra --durations=10 -n auto --dist loadgroup --no-loadscope-reorder

test: $(TEST_STAMP)
	$(PYTEST)

test-fast: $(TEST_STAMP)
	$(PYTEST) -m "not slow and not vllm and not browser"
