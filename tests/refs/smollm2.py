"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) as transformers reads it (its own GGUF
loader and dequantizer): what tests/test_reference.py and tests/test_export.py compare to.
`tokenizer()` needs only transformers' tokenizer (seconds); `model()` loads the model."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.refs import digest, logit_view, rounded

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors: red, green,",
]
CHATS = ["Write a haiku about the ocean.", "Explain what a CPU cache is."]  # 64 greedy tokens each
EXPORT_MESSAGES = [{"role": "user", "content": "Name a planet of the solar system."}]
TEMPLATE_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
TOKENIZER_TEXTS = [
    "Hello world", "  leading and trailing  ", "multiple\n\n\nnewlines\tand\ttabs",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
    "数字 12345 和中文字符，日本語のテキスト", "한국어 텍스트", "emoji 🎉🚀👩‍💻 mixed ✓",
    "numbers 3.14159 and 1,000,000 and 2024-11-29", "<|im_start|>user\nhi<|im_end|>\n",
    "special <|endoftext|> in the middle", "Ünïcödé àccents ñ ß", "a" * 50 + " " * 7 + "b",
    "URL: https://example.com/path?q=1&r=2", "",
]
NUMERICS_TOKENS = 512  # of bench/data/perplexity.txt
NUMERICS_TOP = 16  # kept per position: the exact engine is checked against them
PERPLEXITY_TEXT = Path(__file__).resolve().parents[2] / "bench" / "data" / "perplexity.txt"


def _path() -> Path:
    from pdserve.engine.model.weights import default_model_path

    return default_model_path()


def hf_tokenizer():
    from transformers import AutoTokenizer

    path = _path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tokenizer() -> dict:
    """transformers' tokenizer on TOKENIZER_TEXTS (ids, decoded), its EOS and chat templates."""
    tok = hf_tokenizer()
    texts = [{"text": t, "ids": tok.encode(t, add_special_tokens=True),
              "decoded": tok.decode(tok.encode(t, add_special_tokens=True))} for t in TOKENIZER_TEXTS]
    templates = [{"messages": m, "generation_prompt": gen,
                  "text": tok.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)}
                 for m in (TEMPLATE_MESSAGES, TEMPLATE_MESSAGES[1:2]) for gen in (True, False)]
    return {"texts": texts, "eos_token_id": tok.eos_token_id, "templates": templates}


def model() -> dict:
    """Weights (digests), logits, greedy tokens, prompt logprobs and the numerics text's
    next-token distributions, by transformers' model loaded from the GGUF."""
    from transformers import AutoModelForCausalLM

    path = _path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = hf_tokenizer()
    out = {"weights": {name: digest(t) for name, t in hf.state_dict().items()}}
    with torch.no_grad():
        out["logits"] = []
        for text in PROMPTS:
            ids = tok.encode(text)
            out["logits"].append({"text": text, "ids": ids, **logit_view(hf(torch.tensor([ids])).logits[0])})
        out["greedy"] = []
        for content in CHATS:
            prompt = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
            ids = tok.encode(prompt, add_special_tokens=False)
            # explicit mask: otherwise transformers masks every pad id (= <|im_end|>) in the prompt
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=64, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
            out["greedy"].append({"content": content, "ids": ids, "tokens": ref})
        ids = tok.encode(PROMPTS[2])
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        out["prompt_logprobs"] = {"ids": ids, "logprobs": rounded(lp[p, ids[p + 1]] for p in range(len(ids) - 1)),
                                  "argmax": lp[:-1].argmax(-1).tolist()}
        ids = tok.encode(PERPLEXITY_TEXT.read_text())[:NUMERICS_TOKENS]
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        top = lp.topk(NUMERICS_TOP, dim=-1)
        out["numerics"] = {"ids": ids, "argmax": lp.argmax(-1).tolist(), "top_ids": top.indices.tolist(),
                           "top": [rounded(r) for r in top.values],
                           "top_mass": round(float(top.values.exp().sum(-1).mean()), 4)}
        prompt = tok.apply_chat_template(EXPORT_MESSAGES, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        out["export_greedy"] = {"ids": ids, "tokens": hf.generate(torch.tensor([ids]), max_new_tokens=12,
                                                                  do_sample=False)[0].tolist()}
    return out
