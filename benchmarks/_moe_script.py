"""A Mixtral-shaped Hugging Face model (hidden 1024, 8 experts top-2, 4 layers, 2048 tokens, vocabulary 32000) built
on the meta device and handed to ``tensoropt.parallelize``: the script ``moe_memory.py`` simulates expert-parallel
plans of. Nothing trains: under ``--check-memory`` the runtime simulates the plan's second step and ends the script."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402

import tensoropt  # noqa: E402

CONFIG = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
              max_position_embeddings=2048, use_cache=False, router_jitter_noise=0.0, attention_dropout=0.0)

if __name__ == "__main__":
    config = transformers.AutoConfig.for_model("mixtral", **CONFIG)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tokens = torch.zeros(1, 2048, dtype=torch.long)
    model, _, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-4),
                                          example_inputs={"input_ids": tokens, "labels": tokens}, global_batch=8)
    run.close()
