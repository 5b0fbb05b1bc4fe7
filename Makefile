# The two set-up commands of the README: `make train` (the main job) and `make test`.
# Each installs what it needs first. Where no torch is installed, torch 2.13.0 comes first, so
# that pip takes its CPU wheel instead of resolving the newest CUDA build; a torch already
# there (any release from 2.13 on) is kept.
PYTHON ?= python3
STAMP := .setup-done

.PHONY: setup train plan test test-quick lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

plan: $(STAMP)
	$(PYTHON) -m rannc_fx plan examples.models:gpt_example --world-size 2 --out plan.json

# the main job: torchrun --nproc-per-node 2 examples/train.py, with this Makefile's Python
train: $(STAMP)
	$(PYTHON) -m torch.distributed.run --nproc-per-node 2 examples/train.py

lint: $(STAMP)
	$(PYTHON) -m ruff check rannc_fx tests benchmarks examples
	$(PYTHON) -m mypy

# the whole suite (CI's command, .ci/run): lint, then both tiers on two pytest-xdist workers:
# the forked ranks' cases one after another (xdist group "ranks"), the whole-process scripts
# one after another (group "scripts"), the unit tier around them (tests/README.md): 6.1 min
# here (364 s, load average 3.2)
test: lint
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup tests

# the unit tier alone (tests/unit: no ranks) on two pytest-xdist workers: 1.7 min here
test-quick: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 tests/unit
