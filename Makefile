# The README's two commands: `make demo` and `make test`. Both install first (idempotent).
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"

.PHONY: install demo demo-next test bench sweep mutants config-doc

install:
	$(PIP_INSTALL)

# Main job: the tiny Llama trained on 4 gloo CPU ranks (tp=2, dp=2), printing a falling loss and a summary,
# then the next commands to try (DEMO_NEXT; tests/test_run_summary.py runs its pretrain commands, tiny).
TORCHRUN = $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=4
DEMO_NEXT = \
	"pipeline instead of tensor parallelism (interleaved schedule):" \
	"  $(TORCHRUN) launch/pretrain.py --config configs/tiny.yaml parallel.tp=1 parallel.pp=2 parallel.schedule=interleaved parallel.virtual_stages=2" \
	"ZeRO-3 over the 4 ranks, with held-out evaluation every 20 steps:" \
	"  $(TORCHRUN) launch/pretrain.py --config configs/tiny.yaml parallel.tp=1 parallel.zero=3 train.eval_interval=20" \
	"plan a 70B layout for 64 H100s on this CPU:" \
	"  $(PYTHON) launch/plan.py --config configs/llama3_70b.yaml --world-size 64 --gpu h100" \
	"your own text, a Hugging Face tokenizer and an exported model: docs/getting-started.md" \
	"every configuration key: docs/configuration.md"

demo: install
	$(TORCHRUN) launch/pretrain.py --config configs/tiny.yaml
	@echo; echo "next:"; for line in $(DEMO_NEXT); do echo "  $$line"; done

demo-next:
	@for line in $(DEMO_NEXT); do echo "$$line"; done

# docs/configuration.md from the config dataclasses (tests/test_docs.py fails when it is stale)
config-doc:
	$(PYTHON) launch/config_doc.py > docs/configuration.md

# two pytest-xdist workers on CI's 2 cores, a test file at a time each (so a module's fixtures are built once);
# the 15 slowest tests listed at the end, so one that suddenly dominates the run shows in the CI log.
# compileall first: the suite starts hundreds of Python processes (torchrun ranks, CLI runs), and where
# PYTHONDONTWRITEBYTECODE is set (the project's machine sets it) each one compiled the project's modules from
# source again; with the bytecode written once, a 4-rank launch of tiny costs about 12% less CPU
# (tests/test_launch.py and test_hsdp.py together: 139 s -> 119 s on 2 workers).
test: install
	$(PYTHON) -m compileall -q -j 0 parallel3d kernels models launch benchmarks tests
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=15

bench: install
	$(PYTHON) benchmarks/run_all.py

# Long checks outside CI: every option combination (hours on 2 cores), a clean-exit stress test and the mutants.
sweep: install
	$(PYTHON) -m pytest -q tests/test_sweep.py --full-sweep
	$(PYTHON) -m pytest -q tests/test_convergence.py --full-sweep
	$(PYTHON) -m pytest -q -m sweep --full-sweep
	$(PYTHON) tests/stress_clean_exit.py --runs 40
	$(PYTHON) tests/mutants.py

# Can the tests still fail? Each mutant in tests/mutants.py (a small defect in a parallel path) against the
# test that must fail on it (about 10 minutes on 2 cores; docs/testing.md).
mutants: install
	$(PYTHON) tests/mutants.py
