# Loom's two entry points. Each does all of its own set-up on a fresh Debian 12 machine:
#   make run    install missing packages, configure, build (Release), run the main job
#   make test   install missing packages, configure, build, run the whole ctest suite
#
# BUILD_DIR and JOBS can be overridden. The CUDA backend is compiled and linked (LOOM_CUDA=ON) whenever
# a CUDA toolkit is found, so CI proves it builds even on machines without a GPU; LOOM_CUDA=OFF on the
# command line turns it off.

BUILD_DIR ?= build
JOBS      ?= $(shell nproc)
NVCC      := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
LOOM_CUDA ?= $(if $(NVCC),ON,OFF)

CMAKE_FLAGS := -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=$(LOOM_CUDA)
ifneq ($(NVCC),)
CMAKE_FLAGS += -DCMAKE_CUDA_COMPILER=$(NVCC)
endif

.PHONY: deps configure build docs run test test-avx2 test-sanitize fuzz bench clean

deps:
	./scripts/install-deps

configure: deps
	cmake -S . -B $(BUILD_DIR) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# docs/megatron_flags.md's flag reference, rendered from the flag tables (src/train/flags_*.cpp);
# tests/test_flag_docs.cpp fails when the committed file is stale.
docs: build
	$(BUILD_DIR)/apps/loom help flags --update docs/megatron_flags.md

# The main job: train the default small GPT (gpt-tiny) on the built-in synthetic dataset for 300
# iterations (about half a minute on 2 cores), printing Megatron's log line and a summary.
run: build
	$(BUILD_DIR)/apps/loom train --mock-data --train-iters 300 --lr 2e-3 --min-lr 1e-4 --lr-warmup-iters 20 \
	    --lr-decay-style cosine --log-interval 25 --log-throughput

test: build
	cd $(BUILD_DIR) && ctest -j $(JOBS) --output-on-failure

# The tests whose results depend on the dispatch level (label `isa`: oneDNN's GEMMs, the host Adam, the
# widened bf16 GEMM) with oneDNN and Loom's own dispatch capped at AVX2: what a CPU without AVX-512 runs.
test-avx2: build
	cd $(BUILD_DIR) && ONEDNN_MAX_CPU_ISA=AVX2 LOOM_MAX_CPU_ISA=avx2 ctest -j $(JOBS) -L isa --output-on-failure

# One clang build (build-fuzz/) serves both: every library and test instrumented with AddressSanitizer,
# UBSan and libFuzzer's coverage (LOOM_FUZZ=ON). Line tables are all a sanitizer's report needs (file:line
# in each frame); full debug info would cost a fifth more build time. -O1, as AddressSanitizer's own docs advise:
# clang's -O2 under the sanitizers took a quarter to a third longer per file (the unity file of src/train 97 s
# against 64 s), and the build is most of the two stages' time.
SANITIZE_FLAGS := -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DLOOM_FUZZ=ON -DLOOM_BUILD_TESTS=ON -DLOOM_BUILD_BENCH=OFF \
	-DLOOM_NATIVE=OFF -DLOOM_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	"-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG"

# The unit tests under AddressSanitizer and UBSan (any report fails the test), the emulated CUDA device's
# kernels among them. The exhaustive walk over 2^32 floats takes 8 minutes instrumented, and the *_delayed
# reruns check stream ordering, not memory: both run uninstrumented in `make test`. So do three cases that
# train the same small model for 20 iterations several times over (a minute of the instrumented run between
# them), whose code the other training cases run once, the gpt-oss and DeepSeek-V3 presets' runs (25 s
# instrumented) and the DSA runs (30 s; and under each FP8 recipe), whose layers test_model_grad and test_moe run under
# the sanitizers:
# SANITIZE_SKIP, a gtest filter. And two sweeps of the planner (test_p2p_plan's schedules over PP, VPP and M; test_plan_time's cost
# model over whole step plans: 55 s instrumented) whose code test_schedule and test_plan run under the
# sanitizers on fewer cases.
SANITIZE_SKIP := Training.Fp16TrainsUnderItsLossScalerAndAPowerOfTwoScaleIsExact:Training.TwentyIterationLossCurveMatchesGolden:Training.RunsAreBitwiseReproducible:Training.*PresetTrainsToAFallingLoss:Training.DsaIndexerLossFallsAndIsLogged:Training.DsaIndexerTrainsUnderEachFp8Recipe
test-sanitize: deps
	cmake -S . -B build-fuzz $(SANITIZE_FLAGS)
	cmake --build build-fuzz -j $(JOBS) --target loom_unit_tests
	cd build-fuzz && ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		GTEST_FILTER='-$(SANITIZE_SKIP)' ctest -j $(JOBS) -L unit -LE exhaustive \
		-E '_delayed$$|^test_p2p_plan$$|^test_plan_time$$' --output-on-failure

# The libFuzzer targets from their seed corpora, FUZZ_SECONDS each (fuzz/run).
FUZZ_SECONDS ?= 60
fuzz: deps
	cmake -S . -B build-fuzz $(SANITIZE_FLAGS)
	./fuzz/run $(FUZZ_SECONDS)

bench: build
	$(BUILD_DIR)/bench/bench_core --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
	$(BUILD_DIR)/bench/bench_gemm --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
	$(BUILD_DIR)/bench/bench_step --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
	# Host Adam on 100M parameters against the stream bandwidth, then PyTorch's CPU AdamW on the same
	# (skipped when python3-torch is missing).
	$(BUILD_DIR)/bench/bench_adam --benchmark_report_aggregates_only=true
	/usr/bin/python3 bench/pytorch_adamw.py || true
	bench/dp_scaling.sh $(BUILD_DIR)
	# PyTorch's step of the same model (Debian's python3-torch; skipped when missing). Its f32 step uses
	# generic BLAS and takes minutes.
	/usr/bin/python3 bench/pytorch_step.py --steps 2 --dtype bfloat16 || true
	/usr/bin/python3 bench/pytorch_step.py --steps 1 --dtype float32 || true

clean:
	rm -rf $(BUILD_DIR)
