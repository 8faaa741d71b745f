"""The decode step without Python in the layer loop: `LlamaForCausalLM.forward` hands a
decode step (every row one new token of its request, and small prompt chunks or speculative
drafts with them) to one C call over all layers (engine/kernels/native/step.c), when the model
is the common Llama case that call computes.

LoRA adapters ride along: their updates are added in the C loop by the routine the Python
path calls for them (engine/kernels/native/lora.c).

`prepare(model)` decides once (when native ops are switched on) whether the model qualifies
and builds the per-layer pointer array; `usable(model, kv_caches, meta, after_layer)` is the
per-step check; `forward(...)` runs the step, which stops at a layer's end (step.Stopped) if
it was given a stop word (the `native_stop` of the step's layer hook) and the word falls
below its threshold. Any other layer hook (KV streamed out layer by layer, a pause for a
peer's urgent step) the C step calls where the Python layer loop would (`c_hook`).
A row's result is bitwise the Python path's:
the C loop calls the same kernels on the same inputs in the same order.
"""
from __future__ import annotations

import torch

from pdserve.engine.kernels import native
from pdserve.engine.kernels.attention import AttentionMetadata, NativeAttentionBackend
from pdserve.engine.model.quant import W4A8Linear


def why_not(model) -> str | None:
    """Why the native step cannot run this model (None: it can). Checked once per model."""
    cfg = model.config
    if model.lm_head.weight.device.type != "cpu" or model.lm_head.weight.dtype != torch.float32:
        return "not an fp32 CPU model"
    if cfg.qkv_bias or cfg.qk_norm or cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != cfg.head_dim:
        return "q/k/v biases, qk-norm or a query scale"
    if cfg.hidden_activation == "gelu_pytorch_tanh":
        return "GeGLU, not SwiGLU"
    if cfg.num_experts:
        return "a mixture of experts (its MLPs are routed, engine/model/moe.py)"
    for layer in model.model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not hasattr(layer, "input_layernorm"):
            return "not a Llama decoder layer"
        if attn.window or attn.q_scale or attn.qk_norm or attn.qkv_bias is not None or mlp.gelu:
            return "sliding window, query scale, qk-norm, bias or GeGLU in a layer"
        if not all(isinstance(lin, W4A8Linear) for lin in (attn.qkv_linear, attn.o_linear, mlp.gate_up_linear,
                                                           mlp.down_linear)):
            return "not every matrix on W4A8 weights"
    if cfg.head_dim % 2 or cfg.num_attention_heads % cfg.num_key_value_heads:
        return "odd head_dim or query heads not a multiple of the KV heads"
    return None


def prepare(model):
    """The model's `step.StepWeights`, or None when the native step cannot run it (`why_not`,
    or the kernels are not built here)."""
    if why_not(model) is not None:
        return None
    try:
        from pdserve.engine.kernels.native import step
        cfg = model.config
        nib = lambda lin: (step.nibbles(lin.packed[0]), *lin.packed[1:])  # noqa: E731
        mats = lambda layer: (layer.self_attn.qkv_linear, layer.self_attn.o_linear,  # noqa: E731
                              layer.mlp.gate_up_linear, layer.mlp.down_linear)
        layers = [step.LayerWeights(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                                    *(nib(lin) for lin in mats(layer)), byte_q=tuple(lin.packed[0] for lin in mats(layer)),
                                    half=tuple(step.half_scales(*lin.packed[1:]) for lin in mats(layer)))
                  for layer in model.model.layers]
        eps = {layer.input_layernorm.eps for layer in model.model.layers} | {
            layer.post_attention_layernorm.eps for layer in model.model.layers} | {model.model.norm.eps}
        if len(eps) != 1:
            return None
        return step.StepWeights(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                cfg.intermediate_size, eps.pop(), layers, model.model.norm.weight.data)
    except native.NativeKernelUnavailable:
        return None


_FLOAT_KV, _CODE_KV = (torch.float32, torch.bfloat16), (torch.int8, torch.float8_e4m3fn)


def usable(model, kv_caches: list, meta: AttentionMetadata, after_layer, lora=None) -> bool:
    """Whether this step runs natively: a prepared model, no tensor parallelism, a per-layer
    hook only outside a pipeline (one that only stops the step carries its `native_stop`, which
    the C step reads instead of calling it; any other it calls, `c_hook`), decode and prompt
    rows (a prompt's rows whose attention runs in bf16 vectors, AttentionMetadata.bf16_prompt_ranges, too), the C attention backend and an fp32 or bf16
    cache, or an 8-bit one (int8, fp8) for decode rows only (a prompt's rows attend over a
    decoded copy in the Python path); LoRA adapters (a lora_batch.LoRABatch) with fp32 CPU
    weights; no prompt rows where the model runs them in bf16 on AMX (quant.PromptBf16Linear)."""
    rows = meta.num_decode_tokens + sum(sp.end - sp.start for sp in meta.prefills)
    return (model.native_decode is not None and model.tp is None and rows > 0
            and not (model.prompt_rows is not None and meta.prompt_ranges())  # those run on AMX
            and (after_layer is None or hasattr(after_layer, "native_stop") or model.pp is None)
            and isinstance(model.backend, NativeAttentionBackend)
            and (kv_caches[0][0].dtype in _FLOAT_KV or kv_caches[0][0].dtype in _CODE_KV and not meta.prefills)
            and (lora is None or all(_fp32_cpu(a) for a in lora.adapters)))


def _fp32_cpu(adapter) -> bool:
    m = next((m for layer in adapter.layers for m in layer.values()), None)
    return m is None or (m.a.dtype is torch.float32 and m.a.is_cpu)


def c_hook(after_layer):
    """The layer hook `after_layer` (LlamaForCausalLM.forward's) as step.run's `hook`: it is
    called at each layer's end, and its `within` (if any) at the points inside a layer where the
    layer loop calls it. None for no hook, or one the C step reads as a stop word."""
    if after_layer is None or hasattr(after_layer, "native_stop"):
        return None
    within = getattr(after_layer, "within", None)

    def hook(layer: int, where: int) -> None:
        if where == 0:
            after_layer(layer)
        elif within is not None:
            within()
    return hook


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            meta: AttentionMetadata, lora=None, stop: tuple[int, int] | None = None,
            h: torch.Tensor | None = None, hook=None) -> torch.Tensor:
    """The final normed hidden states of a decode-only step (rows as `meta` orders them);
    `lora`: the rows' adapters (lora_batch.LoRABatch) or None; `stop`: step.run's (the stop
    word's address, the threshold), or None; `h`: the residual stream into the model's layers
    (default: the embeddings of `input_ids`; a pipeline stage's input), contiguous fp32, which
    the step leaves holding the stream after its last layer; `hook`: step.run's (`c_hook`)."""
    from pdserve.engine.kernels.native import step
    from pdserve.engine.kernels.native.lora import StepLoRA
    st = meta.backend_state
    tables, lens = st.get("tables"), st.get("lens")
    if tables is None or tables.dtype is not torch.int64:  # the backend did not prepare this step
        if meta.prefills:
            model.backend.prepare(meta)  # every row's table and length, prompt rows included
            tables, lens = st["tables"], st["lens"]
        else:
            tables, lens = native.paged_attention_tables(meta.decode_block_tables, meta.decode_seq_lens,
                                                         meta.block_size)
    h = model.embed(input_ids).contiguous() if h is None else h
    rotary = model.rotary
    return step.run(model.native_decode, h, kv_caches, positions.to(torch.int64).contiguous(), rotary.cos,
                    rotary.sin, meta.slot_mapping.to(torch.int64).contiguous(), tables, lens,
                    None if lora is None else StepLoRA.of(lora.groups, h.shape[0]), one_team=not meta.prefills,
                    stop=stop, bf16_rows=meta.bf16_prompt_ranges(), hook=hook)
