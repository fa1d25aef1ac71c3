"""The Mixture-of-Experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router scores every expert per token, the top k
run, and their outputs are summed by the router's (renormalised) weights. The experts' matmuls are the plan's
fused_moe op: tokens grouped by expert, each active expert's matrices applied once to all its tokens."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.executor.layers.linear import Linear


class Experts(nn.Module):
    """All experts' weights stacked: gate_up_proj [E, 2 * inter, hidden] (gate rows first), down_proj
    [E, hidden, inter] (transformers' fused layout; per-expert checkpoints are copied in at load)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, shared_expert: nn.Module | None):
        super().__init__()
        self.ops = ops
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, ops)            # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, ops) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.ops.fused_moe(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
