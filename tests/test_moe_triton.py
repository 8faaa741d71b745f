"""The Triton MoE kernel (engine/kernels/triton_moe.py: grouped matmul over the (token, expert)
pairs sorted by expert) against the dense definition of an MoE layer (every expert over
every row, masked by the routing): a prompt-sized and a decode-sized step, a router that sends
every token to the same expert, an expert no token chose, only some experts owned; then
every MoE block of a built Mixtral-shaped model, equal to the torch grouping. Without CUDA the
kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest), fp32, on small
shapes; on CUDA the same tests run it compiled."""
import pytest
import torch

pytest.importorskip("triton", reason="the Triton MoE kernel needs triton (a test dependency on x86-64)")

from pdserve.engine.config import ModelConfig
from pdserve.engine.kernels.triton_moe import moe_experts
from pdserve.engine.model.moe import SparseMoeBlock, group_by_expert, reference_moe, route
from pdserve.engine.model.tiny import tiny_config, tiny_state_dict
from pdserve.engine.model.weights import build_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, model_type="mixtral", num_experts=6, num_experts_per_tok=2,
                  norm_topk_prob=True)


def block(seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    b = SparseMoeBlock(CFG).to(DEVICE)
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.randn(p.shape) * (1.0 if p.shape[0] == CFG.num_experts else p.shape[-1] ** -0.5))
    b.fuse(packed=False)
    return b


def triton_out(b: SparseMoeBlock, x: torch.Tensor, owned: range | None = None) -> torch.Tensor:
    weights, experts = route(x @ b.gate.weight.T, b.top_k, b.renormalize)
    return moe_experts(x, experts, weights, b.gate_up_weight, b.down_weight, owned)


@pytest.mark.parametrize("rows", [1, 3, 37])
def test_grouped_kernel_equals_the_dense_definition(rows):
    b = block()
    x = torch.randn(rows, CFG.hidden_size, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(triton_out(b, x), reference_moe(x, b), atol=2e-5, rtol=1e-5)


def test_skewed_router_and_owned_experts():
    """Every token's first expert is 4 (five experts get no or few pairs); with experts 2..3
    owned, only their pairs count."""
    b = block(1)
    x = torch.randn(29, CFG.hidden_size, device=DEVICE)
    x[:, 0] = 5.0
    with torch.no_grad():
        b.gate.weight.zero_()
        b.gate.weight[4, 0] = 100.0
        b.gate.weight[2, 1] = 1.0
        torch.testing.assert_close(triton_out(b, x), reference_moe(x, b), atol=2e-5, rtol=1e-5)
        weights, experts = route(x @ b.gate.weight.T, 2, True)
        b.owned = range(2, 4)
        want = torch.zeros_like(x)
        for g in group_by_expert(experts, weights, 6, b.owned):
            want.index_add_(0, g.rows, b.experts[g.expert](x[g.rows]) * g.weights.unsqueeze(-1))
        torch.testing.assert_close(triton_out(b, x, b.owned), want, atol=2e-5, rtol=1e-5)


def test_every_block_of_a_built_model_on_the_kernel_equals_the_torch_grouping():
    """build_model's fused MoE blocks (stacked expert weights, as fuse leaves them) on either path."""
    cfg = tiny_config(model_type="mixtral", num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      intermediate_size=32, vocab_size=128)
    model = build_model(cfg, tiny_state_dict(cfg, 3), device=DEVICE, packed_weights=False, quantization="none")
    x = torch.randn(12, cfg.hidden_size, device=DEVICE)
    for blk in model.moe_blocks():
        with torch.no_grad():
            blk.triton = False
            want = blk(x)
            blk.triton = True
            torch.testing.assert_close(blk(x), want, atol=2e-5, rtol=1e-5)
