#!/usr/bin/env bash
# Everything a session that is lent a GPU runs, in one call of under ten minutes:
# first the GPU tests (tests/gpu and every test marked `gpu` elsewhere), then each
# open GPU measurement. Each step has its own time limit, so one that hangs cannot
# take the others' time, and writes its output as a file under OUT (default
# ./gpu-results), which the session copies into benchmarks/RESULTS.md.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_session.sh            # the open measurements
#     OUT=/tmp/gpu bash benchmarks/gpu_session.sh tests      # only the named steps
#
# Steps: env, tests, plan, levers, float8 (open: run by default, about 10 minutes
# together); smoke, hf (measured, in RESULTS.md; by name). A measurement an issue asks for is
# added here as a step when the code it measures lands, so the next GPU session only has
# to run this. float8 needs torchao, which the GPU machine cannot download: first
# `pip download torchao --no-deps -d benchmarks/.wheels` here, then carry that folder.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
STEPS=${*:-env tests plan levers float8}
START=$SECONDS

want() { [[ " $STEPS " == *" $1 "* ]]; }

# step NAME LIMIT_S COMMAND...: runs it with its output in OUT/NAME.txt, its exit
# status and seconds in OUT/steps.txt.
step() {
	local name=$1 limit=$2
	shift 2
	echo "== $name (limit ${limit}s, at $((SECONDS - START))s)"
	local t0=$SECONDS
	timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
	local rc=$?
	echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
	tail -n 5 "$OUT/$name.txt"
}

if want env; then
	# The `scaletrain` command for tests that start it; the image has setuptools.
	$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 ||
		echo "pip install -e . failed: tests that run the scaletrain command will fail"
	# float8 (the float8 step, tests/gpu/test_float8_gpu.py) needs torchao, which the
	# image may lack and the machine cannot download: a wheel carried in benchmarks/.wheels
	# (here: pip download torchao --no-deps -d benchmarks/.wheels) is installed.
	for wheel in benchmarks/.wheels/torchao-*.whl; do
		[[ -e $wheel ]] && $PY -m pip install -q --no-deps "$wheel"
	done
	step env 60 bash -c "nvidia-smi; $PY -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'; git log -1 --format='%H %s' 2>/dev/null || true"
fi

if want tests; then
	# Every GPU-marked test, tests/gpu's and those beside their CPU twins; a module
	# that needs a package the GPU image lacks is reported, not fatal.
	step tests 300 $PY -m pytest -q -p no:cacheprovider -o addopts="" -ra \
		--continue-on-collection-errors -m gpu --timeout 240 tests
fi

if want smoke; then
	# `scaletrain train` on the GPU end to end: a run stopped at step 20 with a profile
	# window, resumed to 40; the resumed run keeps its MFU and step range (summary.json),
	# and the console holds no profiler noise (CUPTI/kineto lines).
	step smoke 200 bash -c '
		set -e; D=$(mktemp -d); R=$D/run
		'"$PY"' -c "from scaletrain.testing import write_fake_mnist; write_fake_mnist(\"$D/data\", n_train=2000, n_test=100)"
		T="'"$PY"' -m scaletrain train --nproc 1 --data-dir $D/data --out $R --batch-size 50 --max-steps 40 --eval-batches 1 --log-every 10"
		$T --stop-after 20 --profile 5-7
		$T
		'"$PY"' -c "import json; s=json.load(open(\"$R/observe/summary.json\")); print(\"summary steps\", s[\"first_step\"], s[\"last_step\"], \"mfu\", s[\"mfu\"])"
		ls $R $R/checkpoints'
fi

if want hf; then
	# Issue 27: the Hugging Face example (examples/hf_llama.py) at about 1B parameters,
	# FSDP, bf16-mixed, sequences of 1024 tokens, batch 8: step time, MFU and CUDA peak
	# from the step ledger (observe/summary.json and the table), 1 GPU.
	step hf 300 bash -c '
		set -e; R=$(mktemp -d)/hf
		HF_LLAMA_BLOCK=1024 '"$PY"' -m scaletrain train --model examples/hf_llama.py:build_1b \
			--strategy fsdp --precision bf16-mixed --nproc 1 --batch-size 8 --max-steps 40 \
			--eval-batches 2 --log-every 10 --ledger-every 10 --no-save-last --out $R
		'"$PY"' -c "import json; s=json.load(open(\"$R/observe/summary.json\")); r=s[\"ranks\"][0]; print(\"step_ms\", round(r[\"step\"]*1e3, 2), \"mfu\", s[\"mfu\"], \"allocated_peak_MiB\", round((r.get(\"allocated_peak\") or 0)/2**20), \"flops_per_step\", r[\"flops_per_step\"], \"steps\", s[\"first_step\"], s[\"last_step\"])"'
fi

if want plan; then
	# Issue 29: this GPU calibrated into a hardware file (kept in OUT, to check in), and
	# the recipes' one-GPU runs beside their plans on it (target: 10% in step time and
	# CUDA peak allocated; the reserved peak beside it is the caching allocator's share,
	# which the hardware files' `reserve` assumes is 15% of the peak), gpt also compiled
	# in float8 on a GPU with float8 matmuls (its compile takes a minute).
	step plan 240 $PY benchmarks/plan_accuracy.py --part here --steps 40 --keep "$OUT/gpu.toml"
fi

if want levers; then
	# Issue 28: the llama recipe at 1B on one GPU in bf16-mixed, each activation
	# checkpointing mode with and without torch.compile (benchmarks/levers.py): step
	# time, tokens/s, MFU and CUDA peak allocated per setting, each in its own process.
	step levers 420 $PY benchmarks/levers.py --size 1b --precision bf16-mixed --batch 4 \
		--seq 2048 --steps 12 --warmup 4
fi

if want float8; then
	# Issue 28: float8 on one GPU of compute capability 8.9+ (benchmarks/levers.py --set
	# float8): the llama recipe's model at 1B in bf16-mixed, compiled, without and with
	# float8: step time, tokens/s, MFU and CUDA peak allocated, each in its own process.
	step float8 180 $PY benchmarks/levers.py --set float8 --size 1b --precision bf16-mixed \
		--batch 4 --seq 2048 --steps 12 --warmup 4
fi

echo "done in $((SECONDS - START))s; results in $OUT"
