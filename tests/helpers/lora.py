"""LoRA reference material for tests: a small random Llama saved as a Hugging Face directory,
PEFT adapters with random non-zero weights made on it (saved in PEFT's format), and what
transformers + peft generate with them (greedy tokens and their logprobs); and a PEFT adapter
written from a base's config alone (`save_gemma_adapter`: for a real GGUF base)."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def peaked_random(model, seed: int = 0):
    """`model`'s weights drawn so that greedy decoding stays far from ties: norms near 1,
    embeddings N(0, 0.25), every other matrix N(0, 1 / fan_in); returns it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
    return model


def save_small_llama(path: Path, seed: int = 0, **fields) -> Path:
    """transformers' LlamaForCausalLM with peaked random weights (greedy far from ties), saved."""
    import transformers

    peaked_random(transformers.LlamaForCausalLM(transformers.LlamaConfig(**(SMALL | fields))).eval(),
                  seed).save_pretrained(path)
    return path


def two_adapters(base: Path, root: Path, prompts, n: int) -> tuple[dict, object, object]:
    """Two adapters on the model at `base`, saved under `root`: ad1 on all seven projections at
    rank 8, ad2 on q, v and down at rank 4 with rsLoRA; and transformers + peft's (tokens,
    logprobs) for each of `prompts` under each ({"ad1": [...], "ad2": [...], None: the base}),
    checked to differ from the base's first token (else the adapters would test nothing).
    Returns (that, ad1's peft model, ad2's)."""
    ad1 = make_adapter(base, root / "ad1", seed=1)
    ad2 = make_adapter(base, root / "ad2", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                       use_rslora=True)
    want = {"ad1": [reference(ad1, p, n) for p in prompts], "ad2": [reference(ad2, p, n) for p in prompts]}
    with ad1.disable_adapter():
        want[None] = [reference(ad1, p, n) for p in prompts]
    for a, b, c in zip(want["ad1"], want["ad2"], want[None]):
        assert a[0] != c[0] and b[0] != c[0], "the adapters must change the greedy output to be tested"
    return want, ad1, ad2


def make_adapter(base: Path, out: Path, seed: int, r: int = 8, alpha: float = 16, targets=None,
                 scale: float = 1.0, **lora_fields):
    """A PEFT LoRA adapter on the model saved at `base` with random non-zero A and B (each
    ~ N(0, scale^2 / fan_in)), saved at `out`; returns the peft model (eval), the reference."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or ALL_TARGETS),
                             init_lora_weights=False, **lora_fields)
    pm = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale * p.shape[-1] ** -0.5)
    pm.save_pretrained(str(out))
    return pm.eval()


def reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """`n` greedy tokens after `prompt` and each one's logprob, by transformers (+ peft when
    `model` is a peft model; wrap in `model.disable_adapter()` for its base)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):  # one full forward per token: the reference needs no KV cache of its own
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    out = ids[len(prompt):]
    return out, [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(out)]


def run_jobs(eng, jobs, params):
    """Add every (id, prompt, adapter) job to the engine `eng` with `params` and step to the
    end; returns {id: (tokens, logprobs)} and the adapters (None: the base) that shared each
    step."""
    for rid, prompt, lora in jobs:
        eng.add_request(rid, prompt, params, lora=lora)
    out = {rid: ([], []) for rid, _, _ in jobs}
    mixes, real = [], eng.runner._lora_batch

    def spy(ordered):  # the adapters of each step's rows
        mixes.append({c.request.lora.name if c.request.lora else None for c in ordered})
        return real(ordered)
    eng.runner._lora_batch = spy
    try:
        while eng.has_unfinished_requests():
            for o in eng.step():
                out[o.request_id][0].extend(o.new_token_ids)
                out[o.request_id][1].extend(lp.logprob for lp in o.logprobs)
    finally:
        del eng.runner._lora_batch
    return out, mixes


def save_gemma_adapter(cfg, out, seed: int = 4, r: int = 4, alpha: float = 8, scale: float = 0.5):
    """A PEFT LoRA adapter for the base of config `cfg` on q_proj, v_proj and down_proj, random
    non-zero weights, written as `PeftModel.save_pretrained` writes one (the tensor names,
    shapes and config fields peft uses); no 1 GB transformers copy of the base needed."""
    import json

    from safetensors.torch import save_file

    from pdserve.engine.model.lora import SECTION, projection_shapes

    g = torch.Generator().manual_seed(seed)
    tensors, shapes = {}, projection_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        for p in ("q_proj", "v_proj", "down_proj"):
            n, k = shapes[p]
            key = f"base_model.model.model.layers.{i}.{SECTION[p]}.{p}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, k, generator=g) * scale * k ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, r, generator=g) * scale * r ** -0.5
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "bias": "none",
        "target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": False, "use_dora": False}))
    return out
