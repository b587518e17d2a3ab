"""Published hand-tuned layouts (issue 33): the workloads the runtime must run in the memory and time Megatron-LM
needs for them. Shared by ``vs_recipes.py`` (the launcher's choice against the recipe, priced the same way) and
``_memory_recipes.py`` (the recipes simulated at full size, for ``memory_accuracy.py``).

Each recipe is a model (a JSON config in ``benchmarks/data/``), a cluster of H100s and one plan: mesh, interleaved
stages, ZeRO 1 (Megatron-LM's distributed optimizer), sequence parallelism, micro-batch, global batch, recomputation.
The models with flash attention (``"attention": "flash"``) keep no attention scores, as Transformer Engine's fused
attention; the GPT-3 175B-shaped model computes its attention eagerly (Megatron's layout, as the ``gpt3-175b``
preset), so its recipes recompute the attention core (selective recomputation), which leaves what flash attention
leaves. The models train without dropout: simulated on the CPU a dropout keeps its mask in the activations' dtype,
where the GPU kernels the capture prices keep a byte per element (a 22B or 175B GPT's memory rows would read a few
percent under their simulation for a CPU artifact; the ``gpt3-175b`` preset has dropout 0.1).

- GPT-3 175B (Brown et al. 2020), dp4 tp4 pp8 with 6 or 12 interleaved stages, micro-batch 1, global batch 256, on
  128 GPUs: the layout issue 33 names for it.
- Nemotron-4 340B-shaped (Nemotron-4 340B technical report, NVIDIA 2024, arXiv 2406.11704: hidden 18432, 96 layers,
  96 heads in 8 key/value groups, squared-ReLU MLP of 73728 (here GELU: the same shapes), 4096 tokens, vocabulary
  256000, untied embeddings, RoPE), dp2 tp8 pp8 v12, micro-batch 1, global batch 32, on 128 GPUs.
- A 22B GPT (Korthikanti et al. 2022, arXiv 2205.05198, Table 3: hidden 6144, 48 layers, 64 heads, 2048 tokens),
  tp8, selective recomputation and sequence parallelism, micro-batch 4, on 8 GPUs (its Table 5 configuration; no
  data parallelism, so no ZeRO).
- Nemotron-4 15B-shaped (Parmar et al. 2024, arXiv 2402.16819: hidden 6144, 32 layers, 48 heads in 8 key/value
  groups, MLP 24576, 4096 tokens, vocabulary 256000), tp2, micro-batch 2, global batch 64, on 16 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

DATA = Path(__file__).resolve().parent / "data"
SCRIPT = "benchmarks/preset_train.py"          # builds the model on meta; what the launcher captures


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str                     # a preset name or a JSON config path (relative to the repository)
    layers: int
    gpus: int
    global_batch: int
    dp: int
    tp: int
    pp: int
    virtual_stages: int
    micro_batch: int
    recompute: str = "none"
    sequence_parallel: bool = True
    zero: int = 1
    memory_row: bool = True        # simulated at full size in memory_accuracy (issue 33's "Done when")
    per_node: int = 8

    def plan(self, precision: str = "bf16-mixed") -> Plan:
        """The recipe as a plan of the torch engine, every copy alike."""
        strategy = LayerStrategy(self.recompute, self.sequence_parallel and self.tp > 1)
        return Plan(devices=self.gpus, dp=self.dp, tp=self.tp, pp=self.pp, virtual_stages=self.virtual_stages,
                    micro_batch=self.micro_batch, global_batch=self.global_batch, zero=self.zero,
                    tp_branches=("attn", "mlp") if self.tp > 1 else (), precision=precision, master_weights=False,
                    dtype="float32" if precision == "32-true" else "bfloat16",
                    blocks=(BlockPlan("layers.*", ((strategy, self.layers // self.pp),)),))

    def script_args(self) -> list[str]:
        return ["--model", self.model, "--global-batch", str(self.global_batch)]

    def launch_args(self) -> list[str]:
        """``tensoropt launch`` arguments for these devices, planned on the h100-80gb profile without GPUs."""
        nodes = self.gpus // self.per_node
        return ["--device", "cuda", "--gpus", str(min(self.per_node, self.gpus)), "--profile", "h100-80gb",
                *(["--nnodes", str(nodes), "--master-addr", "node0"] if nodes > 1 else [])]


RECIPES = [
    Recipe("gpt3-175b-v6", "benchmarks/data/gpt3-175b.json", 96, 128, 256, dp=4, tp=4, pp=8, virtual_stages=6,
           micro_batch=1, recompute="selective"),
    Recipe("gpt3-175b-v12", "benchmarks/data/gpt3-175b.json", 96, 128, 256, dp=4, tp=4, pp=8, virtual_stages=12,
           micro_batch=1, recompute="selective"),
    Recipe("nemotron4-340b", "benchmarks/data/nemotron4-340b.json", 96, 128, 32, dp=2, tp=8, pp=8,
           virtual_stages=12, micro_batch=1),
    Recipe("megatron-22b", "benchmarks/data/megatron-22b.json", 48, 8, 4, dp=1, tp=8, pp=1, virtual_stages=1,
           micro_batch=4, recompute="selective", zero=0),
    Recipe("nemotron4-15b", "benchmarks/data/nemotron4-15b.json", 32, 16, 64, dp=8, tp=2, pp=1, virtual_stages=1,
           micro_batch=2, memory_row=False),
]

__all__ = ["RECIPES", "Recipe", "SCRIPT"]
