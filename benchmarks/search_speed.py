"""Search time of frontier tracking (search only: capture and folding excluded).

- gpt3-175b on 1024 GPUs (128 nodes of 8), global batch 1536, folded (doubling) and copy by copy;
- a 12-layer model of the same width on the same cluster: how search time grows with depth;
- llama2-70b on 512 GPUs.
Each figure is the median of ``--repeats`` in-process runs.

    python benchmarks/search_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _common import write_results

import tensoropt
from tensoropt.cost.model import ModelCost
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.search.ft import SearchSpace, search


def timed(spec: str, devices: int, batch: int, repeats: int, doubling: bool = True,
          pipeline_stages: tuple[int, ...] | None = None) -> dict:
    graph = tensoropt.capture(spec).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(devices, 8, load_profile("a100-80gb")))
    space = SearchSpace(global_batch=batch, pipeline_stages=pipeline_stages)
    runs = [search(model, devices, space, doubling=doubling) for _ in range(repeats)]
    return {"model": graph.name, "layers": model.blocks[0][0].repeats, "devices": devices, "global_batch": batch,
            "folded": doubling, "pipeline_stages": "all even splits" if pipeline_stages is None else
            ",".join(map(str, pipeline_stages)), "search_median_s": statistics.median(r.seconds for r in runs),
            "search_max_s": max(r.seconds for r in runs), "points": len(runs[0].points),
            "candidates": runs[0].candidates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shallow = Path(tmp) / "gpt3-175b-width-12-layers.json"
        shallow.write_text(json.dumps({"family": "gpt", "hidden_size": 12288, "num_layers": 12,
                                       "num_attention_heads": 96, "ffn_hidden_size": 4 * 12288,
                                       "seq_length": 2048, "vocab_size": 50257}))
        rows = [timed("gpt3-175b", 1024, 1536, args.repeats),
                timed(str(shallow), 1024, 1536, args.repeats),
                timed("gpt3-175b", 1024, 1536, args.repeats, pipeline_stages=(1, 2, 4)),
                timed("gpt3-175b", 1024, 1536, max(1, args.repeats // 2), doubling=False),
                timed("llama2-70b", 512, 1024, args.repeats)]
    for r in rows:
        print(r, flush=True)
    ratio = rows[0]["search_median_s"] / rows[1]["search_median_s"]
    same_space = rows[2]["search_median_s"] / rows[1]["search_median_s"]
    lines = ["| model | layers | devices | global batch | pp choices | search | median / max (s) | frontier points | "
             "candidates |", "|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layers']} | {r['devices']} | {r['global_batch']} | "
                     f"{r['pipeline_stages']} | "
                     f"{'folded (doubling)' if r['folded'] else 'copy by copy'} | "
                     f"{r['search_median_s']:.2f} / {r['search_max_s']:.2f} | {r['points']} | {r['candidates']} |")
    verdict = lambda ok: "met" if ok else "not met"   # noqa: E731
    notes = (f"\n96 layers / 12 layers of the same width (folded): {ratio:.2f}x search time over each model's whole "
             f"space, {same_space:.2f}x with the same pipeline choices (12 layers on 1024 GPUs only split into "
             "1, 2 or 4 stages; 96 layers also into 8, 16 and 32, with more interleavings). "
             f"Targets (cost-model issue): <= 1 s for gpt3-175b on 1024 GPUs: "
             f"{verdict(rows[0]['search_median_s'] <= 1.0)}; ratio <= 1.5: {verdict(ratio <= 1.5)} "
             f"({verdict(same_space <= 1.5)} with the same pipeline choices). Copies of a block form at most 16 equal "
             "groups per stage, one strategy each (search/ft.py): chains cost the same at any depth; what still "
             "grows is the number of pipeline splits and the frontier's size.\n")
    write_results("search_speed", rows, "\n".join(lines) + "\n", notes)


if __name__ == "__main__":
    main()
