# cloudseg: `make train` then `make predict`. `make help` lists every target.
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
# uv resolves torch and torchvision as a matching pair; bootstrap it with pip when missing.
UV      := $(or $(shell command -v uv 2>/dev/null),.tools/bin/uv)
# Bytecode compiled at install, as pip does and uv does not: left to Python, a module is compiled at its
# first import, and where that cache cannot be written (PYTHONDONTWRITEBYTECODE, a read-only image) in
# every new process again: a one-image `cloudseg segment` call took 21.4 s on 2 cores, 8.4 s compiled.
# BYTECODE= leaves it out: a throwaway .venv (tests/test_kaggle_data.py's) that no user imports from.
BYTECODE ?= --compile-bytecode
UV_PIP  := $(UV) pip install -q $(BYTECODE)
# make install TORCH_BACKEND=cu126 (or auto: uv picks the build for this machine's driver; cpu, cu118,
# rocm6.3, ...): PyTorch built for that backend instead of requirements.txt's default CUDA build,
# e.g. for a GPU `cloudseg doctor` says PyTorch cannot use. Remembered in .venv for later targets;
# TORCH_BACKEND= (empty) returns to the pinned build.
TORCH_BACKEND ?= $(shell cat $(VENV)/.torch-backend 2>/dev/null)
STAMP   := $(VENV)/.installed$(if $(TORCH_BACKEND),-$(TORCH_BACKEND))
# requirements.txt pins torch of its default CUDA build and that build's CUDA libraries: a named
# backend installs these itself, the newest of its builds that pyproject.toml allows.
TORCH_PINS := ^(torch|torchvision|triton|cuda-[a-z-]+|nvidia-[a-z0-9-]+)==
# The pins this .venv was installed from: later extras (make data's kaggle) take them as constraints.
PINS    := $(if $(TORCH_BACKEND),$(VENV)/requirements-without-torch.txt,requirements.txt)
KAGGLE_STAMP := $(VENV)/.kaggle-installed

# make train: the real job on data/kaggle, or (when that is absent and DATA was not named)
# the CPU demo on a synthetic dataset.
CONFIG  ?= configs/fullres.yaml
DATA    ?= data/kaggle
SYNTH   := data/synthetic
SYNTH_ARGS ?= --n-train 160 --n-test 40 --height 192 --width 288 --seed 0
ARGS    ?=
# make train NPROC=N: N processes (one per GPU) through torchrun (cloudseg.distributed.launch: a failure ends in one line), DDP.
NPROC   ?= 1
TRAIN   := $(if $(filter-out 1,$(NPROC)),$(PY) -m cloudseg.distributed --standalone --nproc_per_node $(NPROC) -m cloudseg train,$(PY) -m cloudseg train)
# make predict: unless RUN is named, the newest folder in runs/ that holds a best.pt itself
# (not runs/cv, whose checkpoints are in its folds: make submit; not a run still in epoch 1).
RUN     ?= $(patsubst %/,%,$(firstword $(foreach d,$(shell ls -td runs/*/ 2>/dev/null),$(if $(wildcard $(d)best.pt),$(d)))))
SUBMISSION ?= submission.csv

# make test: one pytest-xdist worker per core (auto); TEST_WORKERS=0 runs the tests in one process.
# make test-gpu: the tests marked gpu, on a CUDA GPU (make test leaves them out; test-all skips them without one).
TEST_WORKERS ?= auto

# make test-oldest: the suite on the oldest PyTorch that pyproject.toml allows (its torch>= and
# torchvision>=), in .venv-oldest, every other package at its pin but setuptools (torch 2.11 wants <82).
OLDEST_VENV := .venv-oldest
TORCH_FLOOR := $(shell sed -n 's/.*"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
TORCHVISION_FLOOR := $(shell sed -n 's/.*"torchvision>=\([0-9.]*\)".*/\1/p' pyproject.toml)

# make cv / make submit: one run per fold under CV_DIR, tuned together.
FOLDS   ?= 0 1 2 3 4
CV_DIR  ?= runs/cv

.PHONY: help install test test-all test-gpu test-gpu-all test-oldest bench lock clean train predict data cv tune submit tensorboard notebooks lab

help:
	@echo "make train     train CONFIG on DATA (default configs/fullres.yaml on data/kaggle;"
	@echo "               without data/kaggle: the synthetic demo) [ARGS='key=value ...'] [NPROC=N: N GPUs, DDP]"
	@echo "make predict   RUN's best.pt (default: the newest run with one) -> $(SUBMISSION), scored when the data has a solution"
	@echo "make cv        train every fold in FOLDS into CV_DIR/foldK, then tune on their OOF probabilities"
	@echo "               (demo without data/kaggle: folds 0 and 1 of the synthetic data)"
	@echo "make tune      cloudseg tune on every CV_DIR/fold* -> CV_DIR/postprocess.json (make cv runs it)"
	@echo "make submit    all folds of CV_DIR + postprocess.json -> $(SUBMISSION), scored when possible"
	@echo "make data      the kaggle extra into .venv, then the Kaggle data into DATA (needs Kaggle API credentials)"
	@echo "make tensorboard  TensorBoard on runs/ (every run logs to RUN/tb)"
	@echo "make notebooks executes notebooks/*.ipynb headless (outputs stay out of git)"
	@echo "make lab       Jupyter Lab on notebooks/ (installs it on first use)"
	@echo "make install   create .venv (uv) with cloudseg and its dev extras [TORCH_BACKEND=auto|cu126|cu118|cpu|...:"
	@echo "               PyTorch for that backend instead of the pinned CUDA build; see cloudseg doctor]"
	@echo "make test      install if needed, run the fast test suite"
	@echo "make test-all  also run the tests marked slow"
	@echo "make test-gpu  on a CUDA GPU: the tests marked gpu but not slow (decode, host syncs, mixed precision, predict,"
	@echo "               memory, deterministic resume, segment; about 7 minutes on an H100 in pieces, 2026-11-26 to 28)"
	@echo "make test-gpu-all  also the gpu tests marked slow (compiled step and prediction, default-resume noise)"
	@echo "make test-oldest  the fast suite on the oldest PyTorch pyproject.toml allows (torch $(TORCH_FLOOR), in $(OLDEST_VENV))"
	@echo "make bench     on a GPU: the GPU figures in bench/report.md, training first (a 570-s budget; BENCH_ARGS='--parts segment', --budget-s ...);"
	@echo "               on a CPU: the tables of the RLE codec, tuning, training and inference speed, segment"
	@echo "make lock      re-pin requirements.txt from pyproject.toml"
	@echo "make clean     remove .venv, .venv-oldest, .tools and .pytest_cache"

install: $(STAMP)

.tools/bin/uv:
	$(PYTHON) -m venv .tools
	.tools/bin/pip install -q uv

$(STAMP): pyproject.toml requirements.txt | $(UV)
	@# another backend's torch and CUDA libraries would stay behind: start from an empty .venv
	@if [ -d $(VENV) ] && [ "$$(cat $(VENV)/.torch-backend 2>/dev/null)" != "$(TORCH_BACKEND)" ]; then \
	  echo "make install: TORCH_BACKEND changed to '$(TORCH_BACKEND)', recreating $(VENV)"; rm -rf $(VENV); fi
	$(UV) venv -q --allow-existing --python $(PYTHON) $(VENV)
ifeq ($(TORCH_BACKEND),)
	$(UV_PIP) --python $(PY) -r $(PINS) -e '.[dev,geo]'
else
	grep -vE '$(TORCH_PINS)' requirements.txt > $(PINS)
	$(UV_PIP) --python $(PY) --torch-backend $(TORCH_BACKEND) -r $(PINS) -e '.[dev,geo]'
	echo $(TORCH_BACKEND) > $(VENV)/.torch-backend
endif
	rm -f $(VENV)/.installed*
	touch $@

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

test-all: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m ''

# In one process: these tests read and cap this process's GPU memory and compare runs bit for bit.
# Each test's line and any failure's traceback are printed as it ends (tests/report_now.py), and a
# test still running after GPU_HANG_S seconds has every thread's stack dumped: a run cut short says why.
# make test-gpu: the tier that fits a short GPU window (about 7 minutes on an H100 in pieces, 2026-11-26 to 28); make test-gpu-all
# adds the gpu tests also marked slow (inductor's compiles, the default-resume noise study).
GPU_TIER ?= gpu and not slow
GPU_HANG_S ?= 120
test-gpu: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" || { \
	  echo "make $@: needs a CUDA GPU, and PyTorch sees none here (cloudseg doctor says why)"; exit 1; }
	$(PY) -m pytest -n 0 -m "$(GPU_TIER)" -p tests.report_now --report-now -o faulthandler_timeout=$(GPU_HANG_S) --durations=10

test-gpu-all: GPU_TIER = gpu
test-gpu-all: test-gpu

test-oldest: | $(UV)
	$(UV) venv -q --allow-existing --python $(PYTHON) $(OLDEST_VENV)
	grep -vE '$(TORCH_PINS)|^setuptools==' requirements.txt > $(OLDEST_VENV)/requirements-without-torch.txt
	$(UV_PIP) --python $(OLDEST_VENV)/bin/python "torch==$(TORCH_FLOOR).*" \
	  "torchvision==$(TORCHVISION_FLOOR).*" -r $(OLDEST_VENV)/requirements-without-torch.txt -e '.[dev,geo]'
	$(OLDEST_VENV)/bin/python -c "import torch; print('make test-oldest: torch', torch.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal

# make bench: on a CUDA GPU, the GPU figures in one report within a 570-s budget (benchmarks/report.py:
# training first, then memory caps, segment, an epoch, predict; BENCH_ARGS="--budget-s 1500", "--out FILE", ...);
# without one, the CPU tables of the four scripts.
BENCH_ARGS ?=
bench: $(STAMP)
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	  $(PY) benchmarks/report.py $(BENCH_ARGS); \
	else \
	  $(PY) benchmarks/rle_speed.py && $(PY) benchmarks/tune_speed.py && \
	  $(PY) benchmarks/train_speed.py && $(PY) benchmarks/segment_speed.py; \
	fi

lock: | $(UV)
	$(UV) pip compile -q pyproject.toml --extra dev --extra geo --python-version 3.11 -o requirements.txt

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .tools .pytest_cache

train: $(STAMP)
	@if [ -d "$(DATA)" ]; then \
	  $(TRAIN) -c $(CONFIG) --out runs/$$(date +%Y%m%d-%H%M%S) data.dir=$(DATA) $(ARGS); \
	elif [ "$(origin DATA)" != "file" ]; then \
	  echo "make train: no data at DATA=$(DATA)"; exit 1; \
	else \
	  echo "################################################################################"; \
	  echo "# $(DATA) not found: running the CPU DEMO on SYNTHETIC data in $(SYNTH)"; \
	  echo "# (configs/demo.yaml). For the real job: make data, then make train."; \
	  echo "# The demo trains one fold (train.every_fold=false): its 160 images would train every fold,"; \
	  echo "# five times its time. Your own small data trains every fold (docs/cross-validation.md)."; \
	  echo "################################################################################"; \
	  [ -f $(SYNTH)/train.csv ] || $(PY) -m cloudseg synth --out $(SYNTH) $(SYNTH_ARGS) || exit 1; \
	  $(TRAIN) -c configs/demo.yaml --out runs/$$(date +%Y%m%d-%H%M%S) data.dir=$(SYNTH) train.every_fold=false $(ARGS); \
	fi

predict: $(STAMP)
	@if [ -z "$(RUN)" ] || [ ! -f "$(RUN)/best.pt" ]; then echo "make predict: no run with best.pt (run make train, or name RUN=runs/...)"; exit 1; fi
	$(PY) -m cloudseg predict --checkpoint $(RUN)/best.pt --out $(SUBMISSION) $(ARGS)
	@data_dir=$$($(PY) -c "from cloudseg.config import load_config; print(load_config('$(RUN)/config.yaml').data.dir)"); \
	if [ -f "$$data_dir/test_solution.csv" ]; then \
	  echo "scoring $(SUBMISSION) against $$data_dir/test_solution.csv"; \
	  $(PY) -m cloudseg evaluate --submission $(SUBMISSION) --truth $$data_dir/test_solution.csv; \
	fi

# Where the kaggle library (2.2.5) finds credentials, besides KAGGLE_API_TOKEN and KAGGLE_USERNAME/KAGGLE_KEY:
# an API token file, `kaggle auth login`'s OAuth file, a legacy kaggle.json.
KAGGLE_FILES := "$$HOME/.kaggle/access_token" "$$HOME/.kaggle/access_token.txt" "$$HOME/.kaggle/credentials.json" \
	"$${KAGGLE_CONFIG_DIR:-$$HOME/.kaggle}/kaggle.json" "$${XDG_CONFIG_HOME:-$$HOME/.config}/kaggle/kaggle.json"

data: $(STAMP)
	@found=; for file in $(KAGGLE_FILES); do [ -f "$$file" ] && found="$$file"; done; \
	if [ -z "$$KAGGLE_USERNAME$$KAGGLE_API_TOKEN$$found" ]; then \
	  echo "make data: no Kaggle API credentials. Create a token on kaggle.com (Settings > API),"; \
	  echo "save it as ~/.kaggle/access_token (chmod 600) or export KAGGLE_API_TOKEN,"; \
	  echo "accept the rules of the 'understanding_cloud_organization' competition, then run make data again."; \
	  exit 1; fi
	@$(MAKE) -s --no-print-directory $(KAGGLE_STAMP)
	@version=$$($(VENV)/bin/kaggle --version 2>&1) || { \
	  echo "make data: the kaggle CLI in $(VENV) does not start ($$(echo "$$version" | tail -1)); reinstall it: rm $(KAGGLE_STAMP), then make data"; \
	  exit 1; }; echo "$$version"
	$(PY) -m cloudseg download --out $(DATA)

# The kaggle extra (the CLI and its library), resolved with this .venv's pins: torch & co. stay.
$(KAGGLE_STAMP): $(STAMP)
	$(UV_PIP) --python $(PY) -c $(PINS) -e '.[kaggle]'
	touch $@

# Without the Kaggle data (and no DATA named), cv runs the demo: folds 0 and 1 on synthetic data.
cv: $(STAMP)
	@if [ -d "$(DATA)" ]; then config=$(CONFIG); data=$(DATA); folds="$(FOLDS)"; \
	elif [ "$(origin DATA)" != "file" ]; then echo "make cv: no data at DATA=$(DATA)"; exit 1; \
	else echo "### $(DATA) not found: cross-validating the CPU DEMO on SYNTHETIC data (folds 0 1) ###"; \
	  config=configs/demo.yaml; data=$(SYNTH); folds="$(if $(filter command line,$(origin FOLDS)),$(FOLDS),0 1)"; \
	  [ -f $(SYNTH)/train.csv ] || $(PY) -m cloudseg synth --out $(SYNTH) $(SYNTH_ARGS) || exit 1; fi; \
	for k in $$folds; do \
	  if [ -f $(CV_DIR)/fold$$k/oof.npz ]; then echo "fold $$k: done ($(CV_DIR)/fold$$k)"; continue; fi; \
	  if [ -f $(CV_DIR)/fold$$k/last.pt ]; then resume="--resume $(CV_DIR)/fold$$k"; else resume="-c $$config --out $(CV_DIR)/fold$$k"; fi; \
	  $(TRAIN) $$resume data.dir=$$data data.fold=$$k train.every_fold=false $(ARGS) || exit 1; \
	done
	$(MAKE) --no-print-directory tune

tune: $(STAMP)
	@if [ -z "$(wildcard $(CV_DIR)/fold*)" ]; then echo "make tune: no $(CV_DIR)/fold* (run make cv)"; exit 1; fi
	$(PY) -m cloudseg tune $(wildcard $(CV_DIR)/fold*) --out $(CV_DIR)/postprocess.json

submit: $(STAMP)
	@checkpoints="$$(for f in $(wildcard $(CV_DIR)/fold*/best.pt); do printf -- '--checkpoint %s ' $$f; done)"; \
	if [ -z "$$checkpoints" ]; then echo "make submit: no $(CV_DIR)/fold*/best.pt (run make cv)"; exit 1; fi; \
	post=$$( [ -f $(CV_DIR)/postprocess.json ] && echo "--postprocess $(CV_DIR)/postprocess.json" ); \
	$(PY) -m cloudseg predict $$checkpoints $$post --out $(SUBMISSION) $(ARGS) || exit 1; \
	first=$$(ls $(CV_DIR)/fold*/config.yaml | head -1); \
	data_dir=$$($(PY) -c "from cloudseg.config import load_config; print(load_config('$$first').data.dir)"); \
	if [ -f "$$data_dir/test_solution.csv" ]; then \
	  echo "scoring $(SUBMISSION) against $$data_dir/test_solution.csv"; \
	  $(PY) -m cloudseg evaluate --submission $(SUBMISSION) --truth $$data_dir/test_solution.csv; fi

tensorboard: $(STAMP)
	$(VENV)/bin/tensorboard --logdir runs

notebooks: $(STAMP)
	$(PY) -m cloudseg.notebooks notebooks/*.ipynb

lab: $(STAMP)
	$(UV_PIP) --python $(PY) -e '.[lab]'
	$(VENV)/bin/jupyter lab notebooks
