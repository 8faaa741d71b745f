"""Typed configuration of the engine: one dataclass per concern, validated on construction.

Constructors do no I/O; the CLI builds these from its flags, and later the cluster config
composes them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3",  # Hugging Face model_type values pdserve runs
               "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # mixture-of-experts decoders (engine/model/moe.py)
_HF_TYPES = {"gemma3_text": "gemma3"}  # Gemma 3's text-only checkpoints
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
               "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


# the weight quantizations a model loads with (engine/model/quant.py implements them)
QUANTIZATIONS = ("auto", "exact", "none", "int8", "q4_1", "fp16", "w8a8")

@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of the Llama family and its relatives; field names follow Hugging
    Face's configs. `model_type` names the architecture; what sets the relatives apart is a
    field each: biases on q/k/v (Qwen2, `qkv_bias`), a per-head RMSNorm of q and k before RoPE (Qwen3),
    a sliding attention window on all layers or some (Mistral; Qwen2 with use_sliding_window);
    Gemma 3 has all of these but biases, and more (engine/model/gemma3.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"
    qkv_bias: bool = False        # q/k/v projections with biases (o_proj without)
    qk_norm: bool = False         # RMSNorm over each head of q and k, before RoPE
    sliding_window: int = 0       # attend to at most this many latest tokens (0: all)
    layer_types: tuple[str, ...] = ()
    """Per layer, "sliding_attention" or "full_attention" (Hugging Face's `layer_types`);
    empty: every layer slides when `sliding_window` is set."""
    hidden_activation: str = "silu"   # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (Gemma)
    query_pre_attn_scalar: float = 0.0  # attention scores scaled by its -1/2 power (0: head_dim's)
    rope_local_theta: float = 0.0     # RoPE base of the sliding-window layers (0: rope_theta)
    num_experts: int = 0              # experts per mixture-of-experts layer (0: a dense model)
    num_experts_per_tok: int = 0      # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0    # each expert's SwiGLU width (0: intermediate_size)
    norm_topk_prob: bool = False      # rescale the top-k router probabilities to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in an MoE model (Qwen3-MoE's mlp_only_layers)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, run on every token (0: none)

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported architecture {self.model_type!r}: pdserve runs {', '.join(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_activation {self.hidden_activation!r}: pdserve runs "
                             f"{', '.join(ACTIVATIONS)}")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                "sliding_attention", "full_attention"}):
            raise ValueError(f"layer_types must name each of the {self.num_hidden_layers} layers sliding_attention "
                             f"or full_attention, got {self.layer_types}")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        moe = self.model_type in MOE_TYPES
        if moe != (self.num_experts > 0) or moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"a {self.model_type} model needs num_experts {'> 0' if moe else '0'} and 0 < "
                             f"num_experts_per_tok <= num_experts, got {self.num_experts}, {self.num_experts_per_tok}")
        if self.num_experts and not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    def check_runnable(self) -> None:
        """Refuse a configuration the engine would compute wrongly (none known today)."""

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s attention window in tokens (0: it attends to the whole context)."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return 0
        return self.sliding_window

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict."""
        arch = _HF_TYPES.get(d.get("model_type", "llama"), d.get("model_type", "llama"))
        if arch not in MODEL_TYPES:
            raise ValueError(f"unsupported architecture {arch!r}: pdserve runs {', '.join(MODEL_TYPES)}")
        # transformers >= 5 writes RoPE settings as `rope_parameters` (Gemma 3: one per layer
        # type); older ones as rope_theta/rope_scaling (+ rope_local_base_freq)
        scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
        per_type = scaling if "full_attention" in scaling else {"full_attention": scaling}
        for params in per_type.values():
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default":
                raise ValueError(f"unsupported rope_scaling type {kind!r} (only default RoPE is implemented)")
        for capped in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(capped):
                raise ValueError(f"unsupported: {capped}")
        theta = d.get("rope_theta") or per_type["full_attention"].get("rope_theta", 10000.0)
        local_theta = d.get("rope_local_base_freq") or per_type.get("sliding_attention", {}).get("rope_theta", 0.0)
        if d.get("mlp_bias") or (arch not in ("qwen2", "qwen2_moe") and d.get("attention_bias")):
            raise ValueError("unsupported: biases on the attention output or MLP projections "
                             "(attention_bias, mlp_bias)")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        window, layer_types = d.get("sliding_window") or 0, tuple(d.get("layer_types") or ())
        if arch in ("qwen2", "qwen2_moe", "qwen3_moe") and not d.get("use_sliding_window", False):
            window, layer_types = 0, ()  # Qwen2 configs carry a window they do not use
        elif arch == "qwen2" and not layer_types:  # older configs: the layers from max_window_layers on slide
            first = d.get("max_window_layers", d["num_hidden_layers"])
            layer_types = tuple("sliding_attention" if i >= first else "full_attention"
                                for i in range(d["num_hidden_layers"]))
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=theta, rope_local_theta=local_theta if arch == "gemma3" else 0.0,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos, model_type=arch,
            qkv_bias=arch == "qwen2" or arch == "qwen2_moe" and d.get("qkv_bias", True),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "olmoe"), sliding_window=int(window),
            layer_types=layer_types, hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 0.0) if arch == "gemma3" else 0.0,
            **(_hf_moe(d, arch) if arch in MOE_TYPES else {}))

    def to_hf_dict(self) -> dict:
        """The Hugging Face `config.json` equivalent (used to save and to build references)."""
        d = {
            "architectures": [_HF_CLASSES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        }
        if self.num_experts:
            d |= {"num_local_experts": self.num_experts, "num_experts": self.num_experts,
                  "num_experts_per_tok": self.num_experts_per_tok, "norm_topk_prob": self.norm_topk_prob,
                  "moe_intermediate_size": self.moe_intermediate_size, "mlp_only_layers": list(self.dense_layers),
                  "shared_expert_intermediate_size": self.shared_expert_intermediate_size}
        if self.model_type in ("mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"):
            d["sliding_window"] = self.sliding_window or None
        if self.model_type in ("qwen2", "qwen2_moe"):
            d["use_sliding_window"] = bool(self.sliding_window)
        if self.layer_types:
            d["layer_types"] = list(self.layer_types)
        if self.model_type == "gemma3":
            d |= {"model_type": "gemma3_text", "hidden_activation": self.hidden_activation,
                  "query_pre_attn_scalar": self.query_pre_attn_scalar or self.head_dim,
                  "rope_local_base_freq": self.rope_local_theta or self.rope_theta}
        return d


def _hf_moe(d: dict, arch: str) -> dict:
    """The expert fields of an MoE `config.json`: Mixtral always renormalizes its top-k
    probabilities (its experts are intermediate_size wide); the others as `norm_topk_prob`
    says. Qwen-MoE layers listed in mlp_only_layers, or off decoder_sparse_step, have a dense MLP."""
    if d.get("clip_qkv"):
        raise ValueError("unsupported: clip_qkv (OLMoE's clamped q/k/v)")
    n, step = d["num_hidden_layers"], d.get("decoder_sparse_step") or 1
    dense = sorted({*(d.get("mlp_only_layers") or ()), *(i for i in range(n) if (i + 1) % step)})
    return {"num_experts": d.get("num_local_experts") or d.get("num_experts") or 0,
            "num_experts_per_tok": d.get("num_experts_per_tok") or 0,
            "moe_intermediate_size": d.get("moe_intermediate_size") or d["intermediate_size"],
            "norm_topk_prob": arch == "mixtral" or bool(d.get("norm_topk_prob")), "dense_layers": tuple(dense),
            "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size") or 0}


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """Parse a memory size such as `512MiB`, `1GB` or `1073741824` into bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {text!r}; use e.g. 512MiB or 2GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp8", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int = 1 << 30
    """Bytes for the KV cache across all layers (K and V); the block count is derived from it."""
    enable_prefix_caching: bool = True
    """Keep freed full blocks by content hash and reuse them for requests with the same prefix."""
    cache_namespace: str = ""
    """Salt mixed into every block hash (model, LoRA, tenant): different namespaces never share."""
    kv_cache_dtype: str = "auto"
    """What K/V are stored in: "auto" (the model's dtype), "fp32", "bf16" (CPU: half the
    bytes per token, so twice the blocks for the same memory and half the hand-off bytes),
    "int8" or "fp8" (e4m3; one byte per element plus an fp32 scale per token and KV head:
    3.76x the blocks of fp32 for SmolLM2). Attention reads every format in place and
    computes in fp32."""
    kv_host_memory: int = -1
    """Bytes of the host tier under the pool (engine/kv/tiers.py): evicted prefix blocks are
    kept there and copied back on a hit. -1: a quarter of the host's available memory at
    start, at most 8 GiB (nothing is taken until blocks are evicted); 0: off."""
    kv_disk_memory: int = 0
    """Bytes of the disk tier under the host tier (0: off), in a private directory under
    `kv_disk_dir` (default: the system's temporary directory), removed when the engine stops."""
    kv_disk_dir: str = ""

    def __post_init__(self):
        if self.kv_host_memory < -1 or self.kv_disk_memory < 0:
            raise ValueError(f"kv_host_memory must be >= -1 and kv_disk_memory >= 0, got {self.kv_host_memory}, "
                             f"{self.kv_disk_memory}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 64
    """Most requests in one running batch."""
    max_num_batched_tokens: int = 256
    """Token budget of one step (prefill chunks + decode tokens): a burst's first tokens come in
    groups of this many prompt tokens (256, not 512: TTFT p50 ~15% lower, bench/NOTES.md)."""
    long_prefill_token_threshold: int = 0
    """If > 0, cap any one request's prefill chunk at this many tokens per step."""
    yield_chunk: int = 128
    """While a more urgent request (a lower `priority`) runs or waits here, no prompt chunk of a
    less urgent one shares its steps (they stay its own decode step plus `yield_decodes` rows);
    for `urgent_window_s` after one was last here (or while a peer on this host steps for one),
    such chunks take at most this many tokens a step, all together (a step stopped for the urgent
    client's next request throws them away); 0: no cap. A step's fixed cost is ~8 ms on a busy 2-core host."""
    yield_decodes: int = 4
    """While a more urgent request runs or waits here, at most this many less urgent requests
    decode in a step (in turns), so the urgent one's step is not a whole batch of others; 0: no
    such cap."""
    urgent_step_budget: float = 0.15
    """While a more urgent request runs here, less urgent decodes share its steps only as far
    as they add at most this fraction to the step's time (its cost learned from the steps run,
    engine/core/step_cost.py), and at most `yield_decodes` of them."""
    urgent_window_s: float = 5.0
    """How long a worker's steps stay window steps after its last more urgent request (or a
    peer's, on this host): a person's next chat, a few seconds later, finds short steps."""
    window_step_s: float = 0.06
    """The longest a window step may take by the cost model (engine/core/step_cost.py): less
    urgent rows take turns within it (each step takes one at least). An urgent request stops the
    step in flight at a layer's end (it counts for nothing): this bounds the work lost; 0: none."""
    peer_chunk: int = 0
    """Prompt chunks' most tokens while only a peer on this host had more urgent work within its
    window; 0: no cap (a long step pauses for the peer inside each layer, kv_hooks.py: a cap of
    128 cost a flood's prompts 25-30% beside an urgent client, for no gain: bench/NOTES.md)."""

    def __post_init__(self):
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.urgent_window_s < 0 or self.urgent_step_budget < 0 or self.window_step_s < 0:
            raise ValueError(f"urgent_window_s, urgent_step_budget and window_step_s must be >= 0, got "
                             f"{self.urgent_window_s}, {self.urgent_step_budget}, {self.window_step_s}")
        if self.yield_chunk < 0 or self.yield_decodes < 0 or self.peer_chunk < 0:
            raise ValueError(f"yield_chunk, yield_decodes and peer_chunk must be >= 0, got {self.yield_chunk}, "
                             f"{self.yield_decodes}, {self.peer_chunk}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, composed."""

    model: str = ""
    """Path to a GGUF file or a Hugging Face directory; empty for the default model."""
    max_model_len: int = 0
    """Context length in tokens; 0 means the model's own."""
    num_threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    device: str = "cpu"
    dtype: str = "float32"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    detokenize: bool = True
    """Give each output its text and apply stop strings (an engine used on its own; a worker's
    returns token ids only: the router detokenizes)."""
    seed: int = 0
    """Seed for requests that give none."""
    grammar_budget_s: float = 2.0
    """Structured output: a request whose grammar masks take longer than this in all ends with an
    error naming its grammar (0: no limit)."""
    grammar_step_budget_ms: float = 200.0
    """... or whose mask for one token takes longer than this (0: no limit)."""
    speculative_tokens: int = 0
    """Speculative decoding: up to this many tokens proposed per request and step, checked in the
    same step (0: off); without a `speculative_model`, prompt lookup (n-grams of the request's own)."""
    speculative_max_batch: int = 2
    """... only in steps that decode at most this many requests (0: any): checked guesses cost
    rows (prompt lookup: 1.20-1.61x at 1 stream, 0.55-0.93x at 4, bench/experiments/lookup_batch.py)."""
    speculative_model: str = ""
    """The draft model (engine/sampling/draft.py): "self" (this model's weights, quantized as
    `speculative_quantization` says) or a GGUF / HF directory of its tokenizer; "": prompt lookup."""
    speculative_quantization: str = ""
    """The draft's weight quantization (as `quantization`); "": int8 for "self", else this model's."""
    tensor_parallel_size: int = 1
    """Ranks the heads are split over (engine/parallel/tp.py: processes of this host, gloo)."""
    expert_parallel_size: int = 1
    """Ranks a MoE model's experts are split over (engine/parallel/ep.py), at most a layer's; not with tp > 1."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split over (engine/parallel/pp.py), each of tp ranks (PP x TP) or ep (PP x EP)."""
    pipeline_layers: tuple[int, ...] = ()
    """Layers of each stage, stage 0 first (pp.check_stages); (): stage 0 fewer by its extra work (pp.split_layers)."""
    packed_weights: bool = True
    """On CPU (fp32), run linear layers on oneDNN-packed copies of the weights: 1.5-2x faster
    matmuls for the same fp32 math, at the cost of a second copy of the weights."""
    attention: str = "auto"
    """Attention kernels: "auto" (Triton on CUDA, the C kernel on CPU in fp32, else torch; with
    the C kernel, RoPE and SwiGLU run on fused C kernels too), "torch", "native" or "triton"."""
    quantization: str = "auto"
    """Weight quantization applied at load (engine/model/quant.py), CPU only: "auto" (matrices that are
    exactly Q4_1, as a Q4_1 GGUF's layers are, run with int8 activations per 16 on CPUs with
    AVX2, as GGUF runtimes do: perplexity +0.6% on SmolLM2; the Q8_0 head as "exact"), "exact"
    (those matrices read in 4 bits at small batches, fp32 math: the same model as "none"),
    "int8" or "q4_1" (weight-only: 3.5x faster matmuls at one row, fp32 math), "fp16"
    (weight-only), "w8a8" (int8 activations per row, AVX-512 VNNI only: ~5% worse
    perplexity), or "none"."""
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig())
    """LoRA adapters on this engine's model (engine/model/lora.py): how many resident, their
    largest rank, the ones loaded at start."""

    def __post_init__(self):
        if isinstance(self.lora, dict):  # read back from JSON (asdict), as a tensor-parallel rank does
            object.__setattr__(self, "lora", LoRAConfig(**self.lora))
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention not in ("auto", "torch", "native", "triton"):
            raise ValueError(f"attention must be auto, torch, native or triton, got {self.attention!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.speculative_quantization and self.speculative_quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.speculative_quantization!r}")
        if self.speculative_model and self.speculative_tokens <= 0:
            raise ValueError("speculative_model needs speculative_tokens > 0 (how many tokens the draft proposes)")
        tp, ep, pp = self.tensor_parallel_size, self.expert_parallel_size, self.pipeline_parallel_size
        object.__setattr__(self, "pipeline_layers", split := tuple(self.pipeline_layers))  # a list from JSON
        if min(tp, ep, pp, *split) < 1 or (tp > 1 and ep > 1):  # tensor parallelism within expert-parallel: not yet
            raise ValueError(f"tensor_, expert_, pipeline_parallel_size ({tp}, {ep}, {pp}) and each of pipeline_layers "
                             f"({list(split)}) must be >= 1; tensor_ and expert_parallel_size not both > 1: {tp}, {ep}")
        if self.speculative_max_batch < 0:
            raise ValueError(f"speculative_max_batch must be >= 0, got {self.speculative_max_batch}")
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not (self.grammar_budget_s >= 0 and self.grammar_step_budget_ms >= 0):
            raise ValueError("grammar_budget_s and grammar_step_budget_ms must be >= 0")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (PEFT format) served on the base model; see docs/lora.md."""

    max_loras: int = 0
    """Adapters resident (loaded onto the model) at once; beyond it the least recently used
    one no request is using is dropped, and loaded again from its directory when a request
    names it. 0: LoRA off (requests naming an adapter are refused)."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have (a larger one is refused at load)."""
    modules: tuple[tuple[str, str], ...] = ()
    """Adapters loaded when the engine starts: (name, adapter directory) pairs, as vLLM's
    `--lora-modules name=path`."""

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple((str(n), str(p)) for n, p in self.modules))
        if self.max_loras < 0:
            raise ValueError(f"lora.max_loras must be >= 0, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"lora.max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.modules and not self.max_loras:
            raise ValueError("lora.modules needs lora.max_loras > 0 (LoRA is off)")
        if len(self.modules) > self.max_loras:
            raise ValueError(f"lora.modules names {len(self.modules)} adapters, more than lora.max_loras "
                             f"({self.max_loras}) can hold")
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"lora.modules needs distinct, non-empty names, got {names}")
