# The README's two commands: `make demo` and `make test`. Both install first (idempotent).
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"

.PHONY: install demo test bench sweep

install:
	$(PIP_INSTALL)

# Main job: the tiny Llama trained on 4 gloo CPU ranks (tp=2, dp=2), printing a falling loss.
demo: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=4 launch/pretrain.py --config configs/tiny.yaml

test: install
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) benchmarks/run_all.py

# Long checks outside CI: every option combination (hours on 2 cores) and a clean-exit stress test.
sweep: install
	$(PYTHON) -m pytest -q tests/test_sweep.py --full-sweep
	$(PYTHON) -m pytest -q tests/test_convergence.py --full-sweep
	$(PYTHON) tests/stress_clean_exit.py --runs 40
