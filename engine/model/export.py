"""Write a model as a Hugging Face directory: `config.json`, fp32 `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json` (with the chat template) and
`generation_config.json`.

Other servers load this directory where they cannot read our GGUF (vLLM's CPU build reads
safetensors; its GGUF path needs the hub for the tokenizer). The weights are the ones pdserve
serves, dequantized to fp32, so a comparison runs the same model, under the names the family's
checkpoints use (Mixtral's experts as `block_sparse_moe.experts.N.w1/w2/w3`); `config.json`
names the architecture's class and carries no `quantization_config`.
"""
from __future__ import annotations

import json
from pathlib import Path

from pdserve.common.errors import ModelLoadError
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.moe_weights import checkpoint_names
from pdserve.engine.model.weights import load_state_dict, resolve_model_path


def export_hf(model: str, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Export `model` (a GGUF path or '' for the default model) into `out_dir`, created if
    needed. Returns the directory. Raises ModelLoadError if the model cannot be read."""
    import torch
    from safetensors.torch import save_file

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    path = resolve_model_path(model or None)
    state, cfg, _ = load_state_dict(path)
    tok = Tokenizer.from_model_path(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    want = getattr(torch, dtype)
    tensors = {k: v.to(want).contiguous() for k, v in checkpoint_names(state, cfg).items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict() | {"torch_dtype": dtype, "max_position_embeddings": cfg.max_position_embeddings}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tok._tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok, cfg), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def _tokenizer_config(tok: Tokenizer, cfg) -> dict:
    def text(token_id):
        return tok.id_to_token(token_id) if token_id is not None else None

    if tok.eos_token_id is None:
        raise ModelLoadError("the model's tokenizer names no end-of-sequence token")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tok.bos_token_id), "eos_token": text(tok.eos_token_id),
        "unk_token": None, "pad_token": text(tok.eos_token_id),
        "add_bos_token": tok.add_bos, "add_eos_token": False,
        "chat_template": tok.chat_template,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
