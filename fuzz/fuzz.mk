# fuzz/fuzz.mk — libFuzzer harnesses and the sanitizer test run, included
# by the top-level Makefile (docs/security.md, "Fuzzing" and "Sanitizers").
#
#   make fuzz [FUZZ_SECONDS=N] [FUZZ_ONLY="wire npy"]
#        build the harnesses with clang (ASan, UBSan, libFuzzer) into
#        build/fuzz, make the seed corpora from the tests' inputs, replay
#        fuzz/regress/ (every crash ever found) and fuzz each harness for
#        N seconds (default 5).  Fails on any crash, leak or UB.
#   make san-test
#        the unit tests and a subset of the integration tests built with
#        gcc -O1 -fsanitize=address,undefined into build/san.
#
# Both run in sub-makes with their own BUILD directory, so the normal
# build in build/ is untouched.

FUZZ_HARNESSES := wire graph program onnx artifact npy release
FUZZ_ONLY      ?= $(FUZZ_HARNESSES)
FUZZ_SECONDS   ?= 5
FUZZ_CC        ?= clang
FUZZ_BUILD     := $(BUILD)/fuzz
# The models the seeds are made from: the tests' ONNX files.  A long run
# adds the conformance node tests' models (FUZZ_MODELS=...).
FUZZ_MODELS    ?= $(wildcard tests/data/onnx/*.onnx)
FUZZ_FLAGS     ?= -timeout=20 -rss_limit_mb=2560 -print_final_stats=1

# Only the libraries an inference host and the compiler carry: no broker,
# no worker, no client, no server.
FUZZ_A := $(A_COMPILER) $(A_GRAPH) $(A_RUNTIME) $(A_ARTIFACT) $(A_COMMON)

.PHONY: fuzz fuzz-bins fuzz-test san-test san-bins
fuzz: deps
	@$(MAKE) --no-print-directory BUILD=$(FUZZ_BUILD) CC=$(FUZZ_CC) OPT=-O1 \
	  SANITIZE=address,undefined \
	  EXTRA_CFLAGS="-fsanitize=fuzzer-no-link -fno-sanitize-recover=all" fuzz-bins
	@rm -rf $(FUZZ_BUILD)/seeds && \
	  $(FUZZ_BUILD)/bin/fuzz-seeds $(FUZZ_BUILD)/seeds $(FUZZ_MODELS) 2>/dev/null
	@fail=0; for h in $(FUZZ_ONLY); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$h $(FUZZ_BUILD)/crashes; \
	  echo "== fuzz_$$h: fuzz/regress/$$h, then $(FUZZ_SECONDS) s"; \
	  if ls fuzz/regress/$$h 2>/dev/null | grep -q .; then \
	    $(FUZZ_BUILD)/bin/fuzz_$$h $(FUZZ_FLAGS) fuzz/regress/$$h/* \
	      > $(FUZZ_BUILD)/fuzz_$$h.regress.log 2>&1 \
	      || { fail=1; tail -40 $(FUZZ_BUILD)/fuzz_$$h.regress.log; continue; }; fi; \
	  $(FUZZ_BUILD)/bin/fuzz_$$h $(FUZZ_FLAGS) -max_total_time=$(FUZZ_SECONDS) \
	    -artifact_prefix=$(FUZZ_BUILD)/crashes/$$h- \
	    $(FUZZ_BUILD)/corpus/$$h $(FUZZ_BUILD)/seeds/$$h > $(FUZZ_BUILD)/fuzz_$$h.log 2>&1 \
	    || { fail=1; tail -60 $(FUZZ_BUILD)/fuzz_$$h.log; continue; }; \
	  grep -E '^stat::number_of_executed_units|^Done' $(FUZZ_BUILD)/fuzz_$$h.log | tr '\n' ' '; echo; \
	done; exit $$fail

# What `make test` runs: the same, 5 seconds each.
fuzz-test:
	@$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=5

# --- sanitizers ---------------------------------------------------------
# gcc -O1 with ASan and UBSan (every UB report fatal), in build/san: the
# unit tests, and the integration tests that drive kiln's own programs
# over hostile and ordinary inputs, a farm included (SAN_INTEGRATION).
# Not the torch extension (libtorch is not instrumented) nor the tests
# that load kiln's libraries into Python.
SAN_BUILD       := $(BUILD)/san
SAN_INTEGRATION ?= tests/integration/test_hostile_inputs.py tests/integration/test_release.py \
	tests/integration/test_farm.py tests/integration/test_models.py tests/integration/test_depthwise.py \
	tests/integration/test_winograd.py tests/integration/test_gemv.py tests/integration/test_channels_last.py \
	tests/integration/test_prologue.py
SAN_ENV = ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 LSAN_OPTIONS=suppressions=$(CURDIR)/fuzz/lsan.supp
san-test: deps
	@$(MAKE) --no-print-directory BUILD=$(SAN_BUILD) OPT=-O1 SANITIZE=address,undefined \
	  EXTRA_CFLAGS=-fno-sanitize-recover=all san-bins
	@fail=0; for t in $(patsubst $(BUILD)/%,$(SAN_BUILD)/%,$(UNIT_TESTS)); do \
	  echo "== $$t"; $(SAN_ENV) KILN_BIN=$(abspath $(SAN_BUILD)/bin) KILN_SRC=$(CURDIR) $$t \
	    || fail=1; done; exit $$fail
	$(SAN_ENV) KILN_BIN=$(abspath $(SAN_BUILD)/bin) KILN_LIB=$(abspath $(SAN_BUILD)/lib) \
	  KILN_SRC=$(CURDIR) $(PYTHON) -m pytest -q -p no:cacheprovider $(SAN_INTEGRATION)

# In the sub-make (BUILD=build/san): all but the torch extension.
san-bins: $(UNIT_TESTS) $(filter-out $(BIN)/kiln-torch-run,$(PROGRAMS)) $(SO_RT) $(SO_CLIENT)

# In the sub-make (BUILD=build/fuzz, CC=clang).
FUZZ_BINS := $(patsubst %,$(BIN)/fuzz_%,$(FUZZ_HARNESSES)) $(BIN)/fuzz-seeds
fuzz-bins: $(FUZZ_BINS)

$(BIN)/fuzz_%: $(BUILD)/obj/fuzz/fuzz_%.o $(FUZZ_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -fsanitize=fuzzer -o $@ $< $(call LINK_GROUP,$(FUZZ_A)) $(LDLIBS)

# The seed maker is an ordinary program (no libFuzzer main) built the same way.
$(BIN)/fuzz-seeds: $(BUILD)/obj/fuzz/fuzz_seeds.o $(FUZZ_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(call LINK_GROUP,$(FUZZ_A)) $(LDLIBS)
.SECONDARY: $(patsubst %,$(BUILD)/obj/fuzz/fuzz_%.o,$(FUZZ_HARNESSES) seeds)
