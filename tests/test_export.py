"""`pdserve export-hf`: the default model written as a Hugging Face directory is the same
model, for pdserve and for transformers (what vLLM and other servers load)."""
import json

import pytest
import torch

from pdserve.cli import main
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.weights import load_model
from tests import refs
from tests.refs.smollm2 import EXPORT_MESSAGES as MESSAGES


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    assert main(["export-hf", "--out", str(out)]) == 0
    return out


def test_the_directory_is_a_plain_llama_checkpoint(exported):
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert cfg["torch_dtype"] == "float32" and cfg["num_hidden_layers"] == 30
    tok_cfg = json.loads((exported / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "im_start" in tok_cfg["chat_template"]


def test_same_tokens_template_and_logits_as_the_gguf(exported, smollm):
    loaded, tok = smollm
    again = Tokenizer.from_model_path(exported)
    text = "Hello, world! 12345 <|im_start|> ünïcödé"
    assert again.encode(text) == tok.encode(text)
    assert again.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
    assert again.eos_token_id == tok.eos_token_id
    ours, theirs = loaded_state(loaded), loaded_state(load_model(exported))
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name


def test_transformers_loads_it_and_agrees(exported, smollm):
    """transformers' model from the directory generates as its model from the GGUF does (kept
    by `make refs`: tests/data/refs/smollm2.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, tok = smollm
    hf_tok = AutoTokenizer.from_pretrained(str(exported))
    prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt == tok.apply_chat_template(MESSAGES)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert hf_tok(prompt, add_special_tokens=False)["input_ids"] == ids
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ref = refs.load("smollm2")["export_greedy"]
    assert ids == ref["ids"]
    with torch.no_grad():
        ours = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert ours[0].tolist() == ref["tokens"]


def loaded_state(loaded) -> dict[str, torch.Tensor]:
    return {k: v for k, v in loaded.model.state_dict().items() if k.endswith("weight")}
