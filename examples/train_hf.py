"""Train a Hugging Face model this project did not write, built from a small config (nothing downloaded), on
synthetic data; alone or under ``tensoropt launch examples/train_hf.py --device cpu --gpus 2 -- --arch phi3``.

Each architecture has a shape that makes tensor parallelism over it delicate:

- ``phi3`` (``Phi3ForCausalLM``): ``qkv_proj`` is ``[q | k | v]``, sliced at widths the code computes from the
  config (``num_heads * head_dim``): on one rank's share those slices are wrong, so TensorOpt never shards
  attention; ``gate_up_proj`` is ``[gate | up]`` taken by ``chunk(2)``, which it shards by segments (each rank
  holds its part of gate and of up).
- ``gpt2`` (``GPT2LMHeadModel``): every projection is a ``Conv1D`` (weight stored (in, out)); ``c_attn`` is
  split at ``n_embd`` (never sharded), the MLP's ``c_fc -> c_proj`` is.
- ``falcon`` (``FalconForCausalLM``): attention and MLP run in parallel from one input, multi-query attention;
  the MLP's output is added into in place (``mlp_output += attention_output``).
- ``llama`` (``LlamaForCausalLM``): grouped-query attention (2 key/value heads for 4 query heads), rotary tables
  made once before the first layer (relayed between pipeline stages).
- ``qwen3`` (``Qwen3ForCausalLM``): per-head RMSNorm on q and k inside the attention, whose weights' gradients
  would be partial sums over each rank's heads: its attention is kept replicated, the MLP sharded.

Every model's forward returns a ``CausalLMOutput`` with ``.loss`` (the labels shifted inside) and ``.logits``; under
pipeline stages the last one computes that loss (``runtime.pipeline.trace``). Dropout is 0 and the model float32, so
every plan reproduces the losses of this script run alone.
"""

import argparse
import json
import os

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import tensoropt  # noqa: E402

CONFIGS = {
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=2,
                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "falcon": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, multi_query=True, parallel_attn=True,
                   new_decoder_architecture=False, alibi=False, bias=False, vocab_size=128, bos_token_id=1,
                   eos_token_id=2, hidden_dropout=0.0, attention_dropout=0.0),
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  attention_dropout=0.0),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  attention_dropout=0.0),
    "mixtral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, attention_dropout=0.0, router_jitter_noise=0.0),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], vocab_size=128, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, attention_dropout=0.0),
    # Qwen3-MoE whose first two layers are dense (``mlp_only_layers``, as DeepSeek-V3's first three): two blocks
    # whose copies share one module pattern (``graph.block_names``)
    "qwen3_moe_dense_first": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                  decoder_sparse_step=1, mlp_only_layers=[0, 1], vocab_size=128, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, attention_dropout=0.0),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                        first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=128,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0),
}


def build(arch: str, seq_len: int) -> torch.nn.Module:
    positions = "n_positions" if arch == "gpt2" else "max_position_embeddings"
    fields = dict(CONFIGS[arch])
    model_type = fields.pop("model_type", arch)
    config = transformers.AutoConfig.for_model(model_type, **fields, **{positions: seq_len}, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=sorted(CONFIGS), default="phi3")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    parser.add_argument("--save-params", default=None, help="write the final parameters here (.npy, flattened)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build(args.arch, args.seq_len)
    tokens = torch.randint(0, model.config.vocab_size, (args.steps, args.global_batch, args.seq_len),
                           generator=torch.Generator().manual_seed(1))
    example = {"input_ids": tokens[0, :1], "labels": tokens[0, :1]}   # HF shifts the labels itself
    model, _, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                          example_inputs=example, global_batch=args.global_batch)
    losses = []
    for step in range(run.start_step, args.steps):
        losses.append(run.train_step({"input_ids": tokens[step], "labels": tokens[step]}))
        if run.rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    if args.save_params:
        params = run.full_state_dict()                                 # gathered on every rank
        if run.rank == 0:
            np.save(args.save_params, torch.cat([params[k].detach().float().cpu().flatten()
                                                 for k in sorted(params)]).numpy())
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary(), "engine": run.engine}, f)
    run.close()


if __name__ == "__main__":
    main()
