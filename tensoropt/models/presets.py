"""Built-in model presets with their published parameter counts and where those come from."""

from __future__ import annotations

from dataclasses import dataclass

from .resnet import ResNetConfig
from .transformer import TransformerConfig


@dataclass(frozen=True)
class Preset:
    name: str
    family: str                              # gpt | llama | moe | bert | resnet
    config: TransformerConfig | ResNetConfig
    published_parameters: float
    source: str
    rounded: bool = False                    # published only to two significant figures


def _gpt(h: int, layers: int, heads: int, seq: int, vocab: int = 50257) -> TransformerConfig:
    # Megatron-LM / GPT-2 layout: learned positions, LayerNorm, GELU, biases, tied embeddings,
    # dropout 0.1 (GPT-3 paper, sec. 2.3 and Megatron's defaults), explicit attention softmax.
    return TransformerConfig(hidden_size=h, num_layers=layers, num_attention_heads=heads,
                             ffn_hidden_size=4 * h, seq_length=seq, vocab_size=vocab, dropout=0.1)


def _llama(h: int, layers: int, heads: int, kv: int, ffn: int, seq: int, vocab: int,
           theta: float = 10000.0) -> TransformerConfig:
    return TransformerConfig(hidden_size=h, num_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv, ffn_hidden_size=ffn, seq_length=seq,
                             vocab_size=vocab, norm="rmsnorm", activation="swiglu", position="rope",
                             bias=False, tie_embeddings=False, attention="flash", rope_theta=theta)


_HF_GPT2 = "Hugging Face checkpoint openai-community/{} (parameter count of the published weights)"
_GPT3 = ("GPT-3, Brown et al. 2020, Table 2.1 (shapes as trained by Megatron-LM/OPT: head dim = "
         "d_model / heads)")
_LLAMA = "Hugging Face checkpoint meta-llama/{} (parameter count of the published weights)"

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("gpt2-small", "gpt", _gpt(768, 12, 12, 1024), 124_439_808, _HF_GPT2.format("gpt2")),
    Preset("gpt2-medium", "gpt", _gpt(1024, 24, 16, 1024), 354_823_168, _HF_GPT2.format("gpt2-medium")),
    Preset("gpt2-large", "gpt", _gpt(1280, 36, 20, 1024), 774_030_080, _HF_GPT2.format("gpt2-large")),
    Preset("gpt2-xl", "gpt", _gpt(1600, 48, 25, 1024), 1_557_611_200, _HF_GPT2.format("gpt2-xl")),
    Preset("gpt3-1.3b", "gpt", _gpt(2048, 24, 16, 2048), 1.3e9, _GPT3, rounded=True),
    Preset("gpt3-6.7b", "gpt", _gpt(4096, 32, 32, 2048), 6.7e9, _GPT3),
    Preset("gpt3-13b", "gpt", _gpt(5120, 40, 40, 2048), 13.0e9, _GPT3, rounded=True),
    Preset("gpt3-175b", "gpt", _gpt(12288, 96, 96, 2048), 175.0e9, _GPT3),
    Preset("megatron-1t", "gpt", _gpt(25600, 128, 160, 2048, vocab=51200), 1008.0e9,
           "Narayanan et al., SC'21 (arXiv 2104.04473), Table 1, 1T row"),
    Preset("llama2-7b", "llama", _llama(4096, 32, 32, 32, 11008, 4096, 32000), 6_738_415_616,
           _LLAMA.format("Llama-2-7b-hf")),
    Preset("llama2-13b", "llama", _llama(5120, 40, 40, 40, 13824, 4096, 32000), 13_015_864_320,
           _LLAMA.format("Llama-2-13b-hf")),
    Preset("llama2-70b", "llama", _llama(8192, 80, 64, 8, 28672, 4096, 32000), 68_976_648_192,
           _LLAMA.format("Llama-2-70b-hf")),
    Preset("llama3-8b", "llama", _llama(4096, 32, 32, 8, 14336, 8192, 128256, 500000.0), 8_030_261_248,
           _LLAMA.format("Meta-Llama-3-8B")),
    Preset("llama3-70b", "llama", _llama(8192, 80, 64, 8, 28672, 8192, 128256, 500000.0), 70_553_706_496,
           _LLAMA.format("Meta-Llama-3-70B")),
    Preset("bert-large", "bert",
           TransformerConfig(hidden_size=1024, num_layers=24, num_attention_heads=16, ffn_hidden_size=4096,
                             seq_length=512, vocab_size=30522, dropout=0.1, norm_eps=1e-12),
           336e6, "Hugging Face model card google-bert/bert-large-uncased (336M; Devlin et al. 2019 "
           "round it to 340M)"),
    Preset("gpt-moe-1.3b", "moe",
           TransformerConfig(hidden_size=2048, num_layers=24, num_attention_heads=16, ffn_hidden_size=8192,
                             seq_length=2048, vocab_size=50257, dropout=0.1, num_experts=128, moe_every=2),
           52e9, "DeepSpeed-MoE, Rajbhandari et al., ICML'22, Table 1: 1.3B+MoE-128 (52B)"),
    Preset("wide-resnet50-2", "resnet", ResNetConfig(layers=(3, 4, 6, 3), width_per_group=128),
           68_883_240, "torchvision wide_resnet50_2 weights (num_params)"),
    Preset("wide-resnet101-2", "resnet", ResNetConfig(layers=(3, 4, 23, 3), width_per_group=128),
           126_886_696, "torchvision wide_resnet101_2 weights (num_params)"),
]}
