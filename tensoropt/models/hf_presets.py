"""Mixture-of-Experts presets: published Hugging Face configs, built with ``transformers`` on the meta device.

Each is the ``config.json`` of the published checkpoint (the fields that size the model and route its tokens), so
the capture sees the very modules users train: Hugging Face's experts classes with their grouped products, routers
and shared experts. Parameter counts are the publishers' (total; the active ones per token in ``active``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HFPreset:
    name: str
    config: dict[str, Any] = field(hash=False)
    published_parameters: float
    active_parameters: float
    source: str


_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
}
_MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "hidden_act": "silu", "router_jitter_noise": 0.0,
}
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu",
}

HF_PRESETS = {p.name: p for p in (
    HFPreset("qwen3-30b-a3b", _QWEN3_30B_A3B, 30.5e9, 3.3e9,
             "Hugging Face checkpoint Qwen/Qwen3-30B-A3B (config.json; model card: 30.5B total, 3.3B activated)"),
    HFPreset("mixtral-8x7b", _MIXTRAL_8X7B, 46.7e9, 12.9e9,
             "Hugging Face checkpoint mistralai/Mixtral-8x7B-v0.1 (config.json); Jiang et al. 2024, sec. 2: 47B "
             "total, 13B active"),
    HFPreset("deepseek-v3", _DEEPSEEK_V3, 671e9, 37e9,
             "Hugging Face checkpoint deepseek-ai/DeepSeek-V3 (config.json without the multi-token-prediction "
             "module); DeepSeek-AI 2024, sec. 4.2: 671B total, 37B activated"),
)}

__all__ = ["HF_PRESETS", "HFPreset"]
