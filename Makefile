# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install torch + mhc_cg, train the tiny default model in every mode
#               (about 3 min on a busy 2-core machine: ~90 s to install from a warm pip cache,
#               ~90 s for the run, on one CPU thread unless OMP_NUM_THREADS says otherwise)
#   make test   create .venv, install torch + mhc_cg + test extras, run the test suite
# On a GPU machine choose another torch, e.g.  make demo TORCH_SPEC="torch==2.11.0"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/tiny_cpu.yaml
# two pytest workers (at most four where there are more cores); a file's tests share a worker, so
# its module fixtures (the Megatron runs, the GPU-check dry run) run once
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=2; echo $$n)
PYTEST_ARGS ?= -n $(WORKERS) --dist loadfile

STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $@

demo: $(STAMP)
	$(VENV)/bin/mhc-cg train --config $(CONFIG) --compare

# TransformerEngine's pure-Python wheel: its graph.py is what graph.backend te runs (the tests
# run it on the tape) and its mHC kernels are the peers' (mhc-cg kernels --peers). Loaded by path,
# never installed (with it alone, import transformer_engine raises); the tests need it
PEERS_DIR := .cache/peers
$(PEERS_DIR)/.fetched: $(STAMP)
	mkdir -p $(PEERS_DIR)
	$(VENV)/bin/pip download -q --no-deps -d $(PEERS_DIR) transformer-engine==2.20.2 \
		|| { echo "make test: could not fetch TransformerEngine's wheel (transformer-engine==2.20.2, 1.2 MB) into $(PEERS_DIR); the tests run its graph.py"; exit 1; }
	touch $@

test: $(STAMP) $(PEERS_DIR)/.fetched
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .cache
