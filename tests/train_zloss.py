"""A GPT whose loss does more than a cross-entropy on the logits, for the vocabulary-parallel tests: PaLM's
z-loss (Chowdhery et al. 2022, sec. 5) adds ``1e-4 * logsumexp(logits)^2``, which reads the whole logits a second
time, so the vocabulary cannot be split over tensor-parallel ranks (``tensoropt.space.vocab``): the plan must be
priced and run with the head replicated. Runs alone or under ``tensoropt launch tests/train_zloss.py ...``;
float32, dropout 0, so every plan reproduces the losses of this script run alone.
"""

import argparse
import json

import torch
import torch.nn.functional as F

import tensoropt
from tensoropt.models.transformer import DecoderLM, TransformerConfig

CONFIG = dict(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
              vocab_size=128, dropout=0.0)


class ZLossGPT(DecoderLM):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos_embed.weight[:input_ids.shape[1]]
        mask = self.causal_mask[:input_ids.shape[1], :input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x, mask, None)
        logits = self.head(self.norm(x)).view(-1, self.cfg.vocab_size)
        return F.cross_entropy(logits, labels.reshape(-1)) + 1e-4 * logits.logsumexp(-1).pow(2).mean()


def build() -> ZLossGPT:
    torch.manual_seed(0)
    return ZLossGPT(TransformerConfig(**CONFIG))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    args = parser.parse_args()
    model = build()
    tokens = torch.randint(0, CONFIG["vocab_size"], (args.steps, 8, CONFIG["seq_length"] + 1),
                           generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    model, _, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                          example_inputs=(inputs[0, :1], targets[0, :1]), global_batch=8)
    losses = [run.train_step((inputs[step], targets[step])) for step in range(args.steps)]
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary()}, f)
    run.close()


if __name__ == "__main__":
    main()
