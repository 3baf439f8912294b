#!/usr/bin/env bash
# GPU readiness in one script, about 10 minutes on one GPU:
#   (a) bench/pretrain.py: the gpt2-124m preset at sequence length 1024 in bf16 on one GPU (ZeRO-0,
#       torch.compile), the stage against a plain PyTorch loop; prints tokens/s and MFU (target >= 45% on an
#       H100/H200-class GPU);
#   (b) the tiny pipeline (configs/tiny.yaml) end to end on that GPU, printing each stage's metrics.
#
#   bash bench/gpu.sh                  on a machine with a GPU (after `make setup`)
#   bash bench/gpu.sh --cpu-smoke      the same two steps shrunk to a tiny model and a few steps on the CPU
#                                      (what tests/test_infra.py runs), to check the script itself
#
# Everything it writes goes under $GPU_BENCH_ROOT (default: a new temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROOT=${GPU_BENCH_ROOT:-$(mktemp -d -t gptforge-gpu-XXXXXX)}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  # (a) shrunk: the tiny preset, 8 steps, no compilation; (b) shrunk: tokenize and 8 steps of pretraining.
  PRETRAIN=(--steps 8 --repeats 1 --compile off --set tokenizer.vocab_size=320 --set data.demo.pretrain_docs=1500
            --set pretrain.seq_len=64 --set pretrain.micro_batch_size=4 --set pretrain.global_batch_size=8)
  PIPELINE=(--set data.demo.pretrain_docs=1500 --set data.demo.sft_items=200 --set data.demo.preference_pairs=200
            --set data.demo.eval_items=16 --set tokenizer.vocab_size=320 --set model.n_layer=2
            --set pretrain.max_steps=8 --set pretrain.seq_len=64 --set pretrain.micro_batch_size=4
            --set pretrain.global_batch_size=8 --set pretrain.warmup_steps=2 --set reward.policy_samples=0)
  # (the later stages run on the CPU in the tests already: here tokenize and pretrain show the step works)
  PIPELINE+=(--set sft.enabled=false --set reward.enabled=false --set preference.enabled=false)
else
  "$PY" -c "import torch, sys; torch.cuda.is_available() or sys.exit('bench/gpu.sh: no GPU here (torch.cuda.is_available() is False); --cpu-smoke checks the script on the CPU')"
  "$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
  # One GPU, bf16, micro-batch 16 x 1024 tokens with 2 accumulated (32k tokens a step), flash attention (SDPA).
  PRETRAIN=(--steps 120 --compile on --set model.preset=gpt2-124m --set pretrain.seq_len=1024
            --set tokenizer.vocab_size=8192 --set distributed.nproc_per_node=1 --set distributed.zero_stage=0
            --set distributed.precision=bf16 --set pretrain.micro_batch_size=16 --set pretrain.global_batch_size=32
            --set pretrain.warmup_steps=10)
  PIPELINE=(--set eval.items=200)
fi

echo "== (a) pretrain throughput and MFU"
t0=$SECONDS
"$PY" bench/pretrain.py --set "run.root=$ROOT/bench" "${PRETRAIN[@]}"
echo "(a) took $((SECONDS - t0)) s"

echo "== (b) the tiny pipeline end to end"
t0=$SECONDS
# One process, as on the one GPU (the smoke too: it checks this script's path, not the 2-process CPU one)
"$PY" -m gptforge.pipeline.cli run -c configs/tiny.yaml --set "run.root=$ROOT/pipeline" \
  --set distributed.nproc_per_node=1 "${PIPELINE[@]}"
echo "(b) took $((SECONDS - t0)) s"
