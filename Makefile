# kiln — top-level build.
#
#   make deps     install every Debian package the build and tests need
#   make          build programs and libraries into build/
#   make test     unit tests (Check), integration tests (real processes),
#                 the ONNX conformance run, san-test and a 5 s run of each fuzzer
#   make conformance  the ONNX backend node tests through kiln
#   make python-test  the Python package (kiln.trace) against the build
#   make demo     a broker and two workers on loopback compile and run a model
#   make bench-large  a >= 6 GiB model through a farm: memory and times (README)
#   make fuzz     libFuzzer harnesses (clang) for every parser, FUZZ_SECONDS=N each
#   make san-test unit and integration tests under ASan + UBSan (build/san)
#   make install  programs, libraries and the Python package under PREFIX
#   make dist     build/dist/kiln-linux-ARCH.tar.gz (+ .sha256) for the ansible roles
#   make ansible-test  the ansible roles on five real hosts (root; docs/ansible.md)
#
# Every target that compiles or runs something depends on `deps`, so a
# fresh Debian 12 machine needs nothing but `make test`.

.DEFAULT_GOAL := all
SHELL := /bin/bash

BUILD   ?= build
PYTHON  ?= /usr/bin/python3
PREFIX  ?= /usr/local

# Debian packages, by name.  Keep in step with README.md.  curl: README's
# serving step, which tests/integration/test_readme_farm.py runs.
DEB_PACKAGES := build-essential pkg-config \
	libzmq3-dev libczmq-dev libmsgpack-dev libarchive-dev libssl-dev \
	libjansson-dev check libprotobuf-c-dev protobuf-c-compiler \
	libopenblas-dev libonnx-dev openssl tar procps bubblewrap clang libclang-rt-dev \
	python3-torch libtorch-dev python3-torchvision python3-onnx python3-numpy python3-pytest \
	libmicrohttpd-dev \
	ansible-core ansible-lint systemd openssh-server openssh-client iproute2 \
	curl

PKGS := libczmq libzmq msgpack libarchive openssl jansson libprotobuf-c openblas

SANITIZE ?=
OPT      ?= -O2
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g $(OPT) -fPIC -Wall -Wextra -Werror \
	-Wno-unused-parameter -Wshadow -Wformat=2 -pthread \
	-I. -I$(BUILD)/gen
ifneq ($(SANITIZE),)
CFLAGS_BASE += -fsanitize=$(SANITIZE) -fno-omit-frame-pointer
LDFLAGS_SAN := -fsanitize=$(SANITIZE)
endif

# pkg-config is asked lazily (=, not :=) so that it runs after `deps`.
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS))
PKG_LIBS   = $(shell pkg-config --libs $(PKGS))
CHECK_CFLAGS = $(shell pkg-config --cflags check)
CHECK_LIBS   = $(shell pkg-config --libs check)
CFLAGS  = $(CFLAGS_BASE) $(PKG_CFLAGS) $(EXTRA_CFLAGS)
LDLIBS  = $(PKG_LIBS) -lm -lpthread
LDFLAGS = $(LDFLAGS_SAN) -pthread

DEPS_STAMP := $(BUILD)/.deps

# --- sources --------------------------------------------------------
# Files named main_*.c are a program's main; cmd_*.c are kiln CLI
# subcommands.  Everything else in a component folder goes in its library.
lib_src = $(filter-out $(wildcard $(1)/main_*.c) $(wildcard $(1)/cmd_*.c),$(wildcard $(1)/*.c))
obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))

ONNX_PROTO := /usr/include/onnx/onnx.proto
ONNX_GEN   := $(BUILD)/gen/onnx.pb-c.c
ONNX_GEN_H := $(BUILD)/gen/onnx.pb-c.h

COMMON_OBJ   := $(call obj,$(call lib_src,common))
# The wire protocol needs ZeroMQ; the runtime carries the rest of common/.
COMMON_RT_OBJ := $(filter-out $(BUILD)/obj/common/kiln_proto.o,$(COMMON_OBJ))
GRAPH_OBJ    := $(call obj,$(call lib_src,graph)) $(BUILD)/obj/gen/onnx.pb-c.o
COMPILER_OBJ := $(call obj,$(call lib_src,compiler))
ARTIFACT_OBJ := $(call obj,$(call lib_src,artifact))
RUNTIME_OBJ  := $(call obj,$(call lib_src,runtime))
CLIENT_OBJ   := $(call obj,$(call lib_src,client))
BROKER_OBJ   := $(call obj,$(call lib_src,broker))
WORKER_OBJ   := $(call obj,$(call lib_src,worker))
SERVE_OBJ    := $(call obj,$(call lib_src,serve))
KILN_CMD_OBJ := $(call obj,$(wildcard client/cmd_*.c))

LIB := $(BUILD)/lib
BIN := $(BUILD)/bin

A_COMMON   := $(LIB)/libkiln_common.a
A_GRAPH    := $(LIB)/libkiln_graph.a
A_COMPILER := $(LIB)/libkiln_compiler.a
A_ARTIFACT := $(LIB)/libkiln_artifact.a
A_RUNTIME  := $(LIB)/libkiln_runtime.a
A_CLIENT   := $(LIB)/libkiln_client.a
A_BROKER   := $(LIB)/libkiln_broker.a
A_WORKER   := $(LIB)/libkiln_worker.a
A_SERVE    := $(LIB)/libkiln_serve.a

SO_RT     := $(LIB)/libkilnrt.so
SO_CLIENT := $(LIB)/libkilnclient.so

PROGRAMS := $(BIN)/kiln $(BIN)/kiln-broker $(BIN)/kiln-worker $(BIN)/kiln-cc \
	$(BIN)/kiln-run $(BIN)/kiln-torch-run $(BIN)/kiln-serve

# The TorchScript extension (python/kiln/csrc): torch.classes.kiln.Model.
SO_TORCH := $(LIB)/libkiln_torch.so

UNIT_TESTS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(wildcard tests/unit/test_*.c))

.PHONY: bench-farm bench-serve bench-large bench-pipeline bench-upload
.PHONY: bench-kernels bench-kernels-deps
.PHONY: dist ansible-test
.PHONY: all deps test unit-test integration-test demo clean install memcheck \
	python-test conformance bench-runtime bench-deps

all: $(PROGRAMS) $(SO_RT) $(SO_CLIENT) $(SO_TORCH)

# --- deps -----------------------------------------------------------
deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' \
	    || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing$$missing"; \
	  SUDO=; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@mkdir -p $(BUILD) && touch $(DEPS_STAMP)

$(DEPS_STAMP):
	@$(MAKE) --no-print-directory deps

# --- compiling ------------------------------------------------------
$(ONNX_GEN) $(ONNX_GEN_H): $(ONNX_PROTO) | $(DEPS_STAMP)
	@mkdir -p $(BUILD)/gen
	protoc-c --c_out=$(BUILD)/gen -I$(dir $(ONNX_PROTO)) $(ONNX_PROTO)

$(BUILD)/obj/gen/onnx.pb-c.o: $(ONNX_GEN)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -Werror -Wshadow -Wformat=2,$(CFLAGS)) -Wno-unused -c $< -o $@

$(BUILD)/obj/%.o: %.c | $(DEPS_STAMP) $(ONNX_GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# At -O2, gcc 12's "very cheap" cost model vectorises no loop whose trip
# count is unknown, which is every elementwise kernel loop.  Reductions
# stay in order (no -ffast-math), so results do not change.
# (clang, which builds the fuzzers, has no such flag and vectorises these.)
CC_IS_CLANG = $(findstring clang,$(shell $(CC) --version 2>/dev/null | head -1))
GCC_VECT    = $(if $(CC_IS_CLANG),,-fvect-cost-model=cheap)
$(BUILD)/obj/runtime/kiln_kernels.o $(BUILD)/obj/runtime/kiln_kernels_math.o \
$(BUILD)/obj/runtime/kiln_kernels_elementwise.o $(BUILD)/obj/runtime/kiln_kernels_matmul.o \
$(BUILD)/obj/runtime/kiln_kernels_conv.o $(BUILD)/obj/runtime/kiln_kernels_pool.o \
$(BUILD)/obj/runtime/kiln_kernels_reduce.o $(BUILD)/obj/runtime/kiln_kernels_norm.o \
$(BUILD)/obj/runtime/kiln_kernels_binary.o $(BUILD)/obj/runtime/kiln_kernels_dwconv.o \
$(BUILD)/obj/runtime/kiln_kernels_shape.o $(BUILD)/obj/runtime/kiln_winograd.o \
$(call obj,$(wildcard runtime/kiln_gemm*.c)): \
	CFLAGS += $(GCC_VECT)
# The polynomial transcendentals select between values they have all
# computed; without trapping math gcc may do that with vector blends.
# FP exception flags are not part of any kernel's contract.
$(BUILD)/obj/runtime/kiln_vmath.o: CFLAGS += $(GCC_VECT) -fno-trapping-math

$(BUILD)/obj/tests/%.o: tests/%.c | $(DEPS_STAMP) $(ONNX_GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(CHECK_CFLAGS) -MMD -MP -c $< -o $@

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

# --- libraries ------------------------------------------------------
define static_lib
$(1): $(2)
	@mkdir -p $$(dir $$@)
	rm -f $$@ && $$(AR) rcs $$@ $$^
endef
$(eval $(call static_lib,$(A_COMMON),$(COMMON_OBJ)))
$(eval $(call static_lib,$(A_GRAPH),$(GRAPH_OBJ)))
$(eval $(call static_lib,$(A_COMPILER),$(COMPILER_OBJ)))
$(eval $(call static_lib,$(A_ARTIFACT),$(ARTIFACT_OBJ)))
$(eval $(call static_lib,$(A_RUNTIME),$(RUNTIME_OBJ)))
$(eval $(call static_lib,$(A_CLIENT),$(CLIENT_OBJ)))
$(eval $(call static_lib,$(A_BROKER),$(BROKER_OBJ)))
$(eval $(call static_lib,$(A_WORKER),$(WORKER_OBJ)))
$(eval $(call static_lib,$(A_SERVE),$(SERVE_OBJ)))

# The runtime carries only what an inference host needs: no graph IR, no
# compiler, no ZeroMQ.
RT_LIBS = $(shell pkg-config --libs libarchive openssl jansson msgpack openblas) -lm -lpthread
$(SO_RT): $(RUNTIME_OBJ) $(ARTIFACT_OBJ) $(COMMON_RT_OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libkilnrt.so -o $@ $^ $(RT_LIBS)

$(SO_CLIENT): $(CLIENT_OBJ) $(COMPILER_OBJ) $(GRAPH_OBJ) $(RUNTIME_OBJ) $(ARTIFACT_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libkilnclient.so -o $@ $^ $(LDLIBS)

# --- programs -------------------------------------------------------
LINK_GROUP = -Wl,--start-group $(1) -Wl,--end-group

$(BIN)/kiln: $(BUILD)/obj/client/main_kiln.o $(KILN_CMD_OBJ) $(A_CLIENT) $(A_COMPILER) $(A_GRAPH) $(A_RUNTIME) $(A_ARTIFACT) $(A_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(call LINK_GROUP,$(filter %.a,$^)) $(LDLIBS)

# The broker serves /metrics with the HTTP library kiln-serve uses.
BROKER_LIBS = $(shell pkg-config --libs libmicrohttpd)
$(BIN)/kiln-broker: $(BUILD)/obj/broker/main_broker.o $(A_BROKER) $(A_GRAPH) $(A_ARTIFACT) $(A_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(call LINK_GROUP,$(filter %.a,$^)) $(LDLIBS) $(BROKER_LIBS)

$(BIN)/kiln-worker: $(BUILD)/obj/worker/main_worker.o $(A_WORKER) $(A_COMPILER) $(A_GRAPH) $(A_ARTIFACT) $(A_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(call LINK_GROUP,$(filter %.a,$^)) $(LDLIBS)

$(BIN)/kiln-cc: $(BUILD)/obj/compiler/main_cc.o $(A_COMPILER) $(A_GRAPH) $(A_ARTIFACT) $(A_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(call LINK_GROUP,$(filter %.a,$^)) $(LDLIBS)

$(BIN)/kiln-run: $(BUILD)/obj/runtime/main_run.o $(SO_RT)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< -L$(LIB) -lkilnrt -Wl,-rpath,'$$ORIGIN/../lib' $(RT_LIBS)

# kiln-serve: libkilnrt (runtime, artifacts, release records) and an HTTP
# server library, libmicrohttpd (docs/serving.md says why that one).
SERVE_LIBS = $(shell pkg-config --libs libmicrohttpd jansson)
$(BIN)/kiln-serve: $(BUILD)/obj/serve/main_serve.o $(A_SERVE) $(SO_RT)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(A_SERVE) -L$(LIB) -lkilnrt -Wl,-rpath,'$$ORIGIN/../lib' \
	  $(RT_LIBS) $(SERVE_LIBS)

# --- the TorchScript extension --------------------------------------
# C++17 against Debian's libtorch (libtorch-dev), built with the C++11
# ABI as python3-torch is.  The library finds libkilnrt beside it; the
# program finds both in ../lib.  Loading libkiln_torch is what registers
# torch.classes.kiln.Model, so the program links it --no-as-needed: it
# must be loaded before torch::jit::load, whatever the program calls.
TORCH_INC      := -isystem /usr/include/torch/csrc/api/include
TORCH_LIBS     := -ltorch -ltorch_cpu -lc10
TORCH_CXXFLAGS  = -std=c++17 -g $(OPT) -fPIC -Wall -Wextra -Werror \
	-Wno-unused-parameter -pthread -D_GLIBCXX_USE_CXX11_ABI=1 -I. $(TORCH_INC)
ifneq ($(SANITIZE),)
TORCH_CXXFLAGS += -fsanitize=$(SANITIZE) -fno-omit-frame-pointer
endif

$(BUILD)/obj/python/kiln/csrc/%.o: python/kiln/csrc/%.cpp | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(TORCH_CXXFLAGS) -MMD -MP -c $< -o $@

$(SO_TORCH): $(BUILD)/obj/python/kiln/csrc/kiln_torch.o $(SO_RT)
	@mkdir -p $(dir $@)
	$(CXX) -shared $(LDFLAGS) -Wl,-soname,libkiln_torch.so -o $@ $< \
	  -L$(LIB) -lkilnrt -Wl,-rpath,'$$ORIGIN' $(TORCH_LIBS)

$(BIN)/kiln-torch-run: $(BUILD)/obj/python/kiln/csrc/kiln_torch_run.o $(SO_TORCH)
	@mkdir -p $(dir $@)
	$(CXX) $(LDFLAGS) -o $@ $< -L$(LIB) -Wl,--no-as-needed -lkiln_torch \
	  -Wl,--as-needed -lkilnrt -Wl,-rpath,'$$ORIGIN/../lib' $(TORCH_LIBS)

# --- tests ----------------------------------------------------------
ALL_A := $(A_SERVE) $(A_CLIENT) $(A_BROKER) $(A_WORKER) $(A_COMPILER) $(A_GRAPH) $(A_RUNTIME) $(A_ARTIFACT) $(A_COMMON)

# Every unit test links tests/unit/testlib.c, the helpers they share.
# Kept, not removed as an intermediate of the first test that needs it.
TESTLIB_OBJ := $(BUILD)/obj/tests/unit/testlib.o
.SECONDARY: $(TESTLIB_OBJ)

$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.o $(TESTLIB_OBJ) $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(TESTLIB_OBJ) $(call LINK_GROUP,$(ALL_A)) $(LDLIBS) $(BROKER_LIBS) $(CHECK_LIBS)

unit-test: $(UNIT_TESTS) all
	@fail=0; for t in $(UNIT_TESTS); do \
	  echo "== $$t"; KILN_BIN=$(abspath $(BIN)) KILN_SRC=$(CURDIR) $$t || fail=1; done; \
	  exit $$fail

integration-test: all
	KILN_BIN=$(abspath $(BIN)) KILN_LIB=$(abspath $(LIB)) KILN_SRC=$(CURDIR) \
	  $(PYTHON) -m pytest -q -p no:cacheprovider tests/integration

test: deps
	@$(MAKE) --no-print-directory unit-test
	@$(MAKE) --no-print-directory integration-test
	@$(MAKE) --no-print-directory python-test
	@$(MAKE) --no-print-directory conformance
	@$(MAKE) --no-print-directory san-test
	@$(MAKE) --no-print-directory fuzz-test

# The Python package (kiln.trace, python/kiln) against the built libraries.
# An ASan-built library needs the ASan runtime (and, for torch's C++
# exceptions, libstdc++) loaded first into the uninstrumented python3.
PY_SAN_ENV = $(if $(findstring address,$(SANITIZE)),LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libstdc++.so)" ASAN_OPTIONS=detect_leaks=0)
python-test: all
	$(PY_SAN_ENV) KILN_BIN=$(abspath $(BIN)) KILN_LIB=$(abspath $(LIB)) KILN_SRC=$(CURDIR) \
	  $(PYTHON) -m pytest -q -p no:cacheprovider tests/python

# The ONNX backend node tests through kiln (docs/conformance.md).  Their
# data is generated from python3-onnx's test cases when it is missing.
CONFORMANCE_DIR := $(BUILD)/conformance
conformance: all
	@test -d $(CONFORMANCE_DIR)/data/node || \
	  $(PYTHON) tests/conformance/gen_data.py $(CONFORMANCE_DIR)/data
	KILN_BIN=$(abspath $(BIN)) KILN_LIB=$(abspath $(LIB)) KILN_SRC=$(CURDIR) \
	  $(PYTHON) tests/conformance/run_conformance.py \
	  --data $(CONFORMANCE_DIR)/data/node --out $(CONFORMANCE_DIR) \
	  --baseline tests/conformance/baseline.txt

include fuzz/fuzz.mk

memcheck: $(UNIT_TESTS)
	@fail=0; for t in $(UNIT_TESTS); do \
	  CK_FORK=no KILN_BIN=$(abspath $(BIN)) KILN_SRC=$(CURDIR) valgrind -q --error-exitcode=1 \
	    --leak-check=full $$t || fail=1; done; exit $$fail

demo: all
	$(PYTHON) scripts/demo.py --bin $(abspath $(BIN))

# The farm's benchmarks (bench/bench_farm.py): printed numbers, not tests.
$(BUILD)/bench/bench_farm: $(BUILD)/obj/bench/bench_farm.o $(A_CLIENT) $(A_COMPILER) $(A_GRAPH) $(A_RUNTIME) $(A_ARTIFACT) $(A_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(call LINK_GROUP,$(filter %.a,$^)) $(LDLIBS)

bench-farm: all $(BUILD)/bench/bench_farm
	$(PYTHON) bench/bench_farm.py --bin $(abspath $(BIN)) --bench $(abspath $(BUILD)/bench/bench_farm)

# A model of >= 6 GiB of float32 weights in ONNX external data through a
# farm (bench/bench_large.py): peak RSS of client, broker, worker and
# kiln-run against the weights, cold compile, cache hit, uploads.  Needs
# ~30 GB of disk under /var/tmp; not part of make test.
$(BUILD)/bench/bench_large: $(BUILD)/obj/bench/bench_large.o $(A_CLIENT) $(A_COMPILER) $(A_GRAPH) $(A_RUNTIME) $(A_ARTIFACT) $(A_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(call LINK_GROUP,$(filter %.a,$^)) $(LDLIBS)

BENCH_LARGE_GIB ?= 6
bench-large: all $(BUILD)/bench/bench_farm $(BUILD)/bench/bench_large
	$(PYTHON) bench/bench_large.py --bin $(abspath $(BIN)) --bench-farm $(abspath $(BUILD)/bench/bench_farm) \
	  --gib $(BENCH_LARGE_GIB)

# The upload alone (bench/bench_upload.py): MiB/s to a fresh broker beside
# SHA-256 on one core and raw ZeroMQ, and CPU per GiB of broker and client.
bench-upload: $(BIN)/kiln $(BIN)/kiln-broker $(BUILD)/bench/bench_farm
	$(PYTHON) bench/bench_upload.py --bin $(abspath $(BIN)) --bench-farm $(abspath $(BUILD)/bench/bench_farm)

# kiln against PyTorch on the CPU, side by side (bench/bench_runtime.py):
# prints the README's table; asserts nothing about time.
bench-runtime: all bench-deps
	KILN_BIN=$(abspath $(BIN)) $(PYTHON) bench/bench_runtime.py

# ONNX Runtime's CPU build, the baseline of bench-runtime: the npm
# package's install script only fetches GPU parts, so it is skipped.
# Benchmarks only: `make test` does not need it.
BENCH_DEPS := $(BUILD)/bench-deps
bench-deps:
	@test -d $(BENCH_DEPS)/node_modules/onnxruntime-node || { \
	  command -v npm >/dev/null || { SUDO=; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	    $$SUDO apt-get install -y -qq --no-install-recommends nodejs npm; }; \
	  mkdir -p $(BENCH_DEPS) && cd $(BENCH_DEPS) && \
	  npm install --ignore-scripts --no-audit --no-fund onnxruntime-node; }

# kiln's convolutions and matrix products one at a time against oneDNN,
# XNNPACK, BLIS and OpenBLAS on the same data (bench/bench_kernels.py,
# docs/engine.md's table).  The libraries are Debian's; BLIS's serial
# build is unpacked under build/bench-deps, not installed, so that it
# never becomes the system's libblas.so.3.  Benchmarks only.
BLIS_LIB := $(BENCH_DEPS)/blis/usr/lib/x86_64-linux-gnu/blis-serial/libblis.so.4
bench-kernels-deps:
	@test -e /usr/include/oneapi/dnnl/dnnl.h -a -e /usr/include/xnnpack.h \
	  -a -e /usr/include/pthreadpool.h || { SUDO=; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	  $$SUDO apt-get install -y -qq --no-install-recommends libdnnl-dev libxnnpack-dev \
	    libpthreadpool-dev; }
	@test -e $(BLIS_LIB) || { mkdir -p $(BENCH_DEPS)/blis-deb && cd $(BENCH_DEPS)/blis-deb && \
	  apt-get download libblis4-serial && dpkg -x libblis4-serial_*.deb ../blis; }

$(BUILD)/bench/bench_kernels: bench/bench_kernels.c | bench-kernels-deps
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -o $@ $< -ldnnl -lXNNPACK -lopenblas -ldl -lm

bench-kernels: all $(BUILD)/bench/bench_kernels
	KILN_BIN=$(abspath $(BIN)) $(PYTHON) bench/bench_kernels.py \
	  --tool $(abspath $(BUILD)/bench/bench_kernels) --blis $(abspath $(BLIS_LIB))

# kiln-serve against kiln-run --bench on the same artifact (bench/bench_serve.py):
# prints the README's serving table; asserts nothing about time.
bench-serve: all
	KILN_BIN=$(abspath $(BIN)) KILN_SRC=$(CURDIR) $(PYTHON) bench/bench_serve.py

# --pipeline-cores 2 against 1 core and 2 replicas on a stream of 32
# (bench/bench_pipeline.py): prints the README's pipelining table.
bench-pipeline: all
	KILN_BIN=$(abspath $(BIN)) $(PYTHON) bench/bench_pipeline.py

# The Python package goes where Debian's python3 looks: /usr/lib/python3/
# dist-packages for PREFIX=/usr, else PREFIX/lib/python3.X/dist-packages.
# kiln/_paths.py records where the libraries and programs went.
PY_VERSION = $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PYTHON_DIR ?= $(if $(filter /usr,$(PREFIX)),$(PREFIX)/lib/python3/dist-packages,$(PREFIX)/lib/python$(PY_VERSION)/dist-packages)

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib
	install -m 0755 $(PROGRAMS) $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(SO_RT) $(SO_CLIENT) $(SO_TORCH) $(DESTDIR)$(PREFIX)/lib/
	install -d $(DESTDIR)$(PYTHON_DIR)/kiln
	install -m 0644 python/kiln/*.py $(DESTDIR)$(PYTHON_DIR)/kiln/
	printf 'LIBDIR = "%s"\nBINDIR = "%s"\n' "$(PREFIX)/lib" "$(PREFIX)/bin" \
	  > $(DESTDIR)$(PYTHON_DIR)/kiln/_paths.py

# --- dist: what the ansible roles install on every host ---------------
# build/bin, the shared libraries of build/lib (the static ones are only
# for linking) and the Python package, as one tarball with its SHA-256
# beside it.  The tarball is reproducible for one build (sorted names,
# mtime 0, owner 0, gzip -n), so rolling out the same build twice changes
# nothing on the hosts.  kiln/python/kiln/_paths.py points at kiln/lib and
# kiln/bin wherever the tarball is unpacked.
DIST_DIR  := $(BUILD)/dist
DIST_NAME := kiln-linux-$(shell uname -m)
DIST_TAR  := $(DIST_DIR)/$(DIST_NAME).tar.gz
dist: all
	@rm -rf $(DIST_DIR)/stage && mkdir -p $(DIST_DIR)/stage/kiln/bin \
	  $(DIST_DIR)/stage/kiln/lib $(DIST_DIR)/stage/kiln/python/kiln
	cp -p $(BIN)/* $(DIST_DIR)/stage/kiln/bin/
	cp -p $(LIB)/*.so $(DIST_DIR)/stage/kiln/lib/
	cp -p python/kiln/*.py $(DIST_DIR)/stage/kiln/python/kiln/
	printf 'import os\n_top = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")\nLIBDIR = os.path.normpath(os.path.join(_top, "lib"))\nBINDIR = os.path.normpath(os.path.join(_top, "bin"))\n' \
	  > $(DIST_DIR)/stage/kiln/python/kiln/_paths.py
	git describe --always --dirty > $(DIST_DIR)/stage/kiln/VERSION 2>/dev/null || echo unknown > $(DIST_DIR)/stage/kiln/VERSION
	tar -C $(DIST_DIR)/stage --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
	  --format=gnu -cf - kiln | gzip -9n > $(DIST_TAR).tmp
	mv $(DIST_TAR).tmp $(DIST_TAR)
	cd $(DIST_DIR) && sha256sum $(DIST_NAME).tar.gz > $(DIST_NAME).tar.gz.sha256
	@rm -rf $(DIST_DIR)/stage
	@echo "make dist: $(DIST_TAR) ($$(cut -c1-16 $(DIST_TAR).sha256)...)"

# The ansible roles on real hosts (docs/ansible.md): a broker, two workers
# and two inference hosts, each a network namespace with its own root
# (overlayfs), PID 1 and sshd, driven by ansible-playbook over SSH.  Needs
# root (namespaces, mounts); takes a few minutes.  Not part of `make test`.
ansible-test: deps dist
	KILN_BIN=$(abspath $(BIN)) KILN_SRC=$(CURDIR) KILN_DIST=$(abspath $(DIST_TAR)) \
	  $(PYTHON) -m pytest -q -p no:cacheprovider tests/ansible

clean:
	rm -rf $(BUILD)
