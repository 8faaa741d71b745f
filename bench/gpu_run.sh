#!/bin/bash
# The device check as one command on a GPU machine with torch and triton but not pdserve's
# other dependencies or the default model (bench/gpu_check.py): pdserve importable from the
# checkout, a random SmolLM2-shaped model for the tensor-parallel check, the results in $OUT.
set -u
mkdir -p /tmp/pkg/pdserve && cp -r pdserve/. /tmp/pkg/pdserve/
for d in common engine protos kv_transfer registry router prefill_worker decode_worker deploy bench; do
  ln -sfn "$PWD/$d" "/tmp/pkg/pdserve/$d"
done
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 - <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                  rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained("/tmp/smol-random", safe_serialization=True)
print("random SmolLM2-shaped model in /tmp/smol-random")
PY
python3 bench/gpu_check.py /tmp/smol-random 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
cp bench/gpu-results.json "${OUT:-/tmp}/" 2>/dev/null
