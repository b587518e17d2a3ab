"""GPU smoke test: does ``tensoropt launch`` train on the GPUs, and train right?

On whatever GPUs are visible, launches ``examples/train_gpt.py`` through ``tensoropt launch`` with each
engine (the model built on the host, and built on the meta device; DeepSpeed also with ZeRO 3, which cuts
the meta-built model into partitions as it gets storage) and prints per run: where the parameters were,
the median step time, ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` (peaks after the
first step) against the plan's prediction, and the largest relative loss difference from the same script
run alone (built on the host: where the script leaves it; built on meta: materialised whole on ``cuda:0``).
Results go to ``results/gpu_smoke.{md,json}``.

On a machine without GPUs it prints one line and exits 0. ``--device cpu`` runs the same launches on
CPU workers (to check this script itself), written to ``results/gpu_smoke_cpu.*``. GPU workers keep the
launcher's host threads; only CPU workers get ``OMP_NUM_THREADS=1``.

    python benchmarks/gpu_smoke.py [--gpus N] [--hidden 1024 --layers 8 --seq-len 512 --global-batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _common import write_results
from _launch import launched, run

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "examples" / "train_gpt.py")
LOSS_RTOL = 1e-4       # same maths in another order (gradient reductions, kernels): equal to about 1e-5
# (engine, script arguments, launch arguments); the last: DeepSpeed ZeRO 3 cuts the meta-built model into partitions
RUNS = [("torch", [], []), ("torch", ["--meta"], []), ("deepspeed", ["--meta"], []),
        ("deepspeed", ["--meta"], ["--zero", "3"])]


def launched_gpt(engine: str, script_args: list[str], launch_args: list[str], args, device: list[str], tmp: Path,
                 env: dict) -> dict:
    return launched(SCRIPT, ["--gpus", str(args.gpus), *device, "--engine", engine, *launch_args],
                    [*args.model, *script_args], tmp / f"run-{engine}-{len(script_args)}-{len(launch_args)}", env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpus", type=int, default=None, help="default: all visible (2 CPU workers with --device cpu)")
    parser.add_argument("--hidden", type=int, default=None, help="default 1024 on GPUs, 64 on CPUs")
    parser.add_argument("--layers", type=int, default=None, help="default 8 on GPUs, 4 on CPUs")
    parser.add_argument("--seq-len", type=int, default=None, help="default 512 on GPUs, 32 on CPUs")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    import torch
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("gpu_smoke: no GPU visible (torch.cuda.is_available() is False): skipped; --device cpu runs it on CPU "
              "workers")
        return
    args.gpus = args.gpus or (torch.cuda.device_count() if gpu else 2)
    args.model = ["--hidden", str(args.hidden or (1024 if gpu else 64)), "--layers",
                  str(args.layers or (8 if gpu else 4)), "--seq-len", str(args.seq_len or (512 if gpu else 32)),
                  "--global-batch", str(args.global_batch), "--steps", str(args.steps)]
    env = {**os.environ} | ({} if gpu else {"OMP_NUM_THREADS": "1"})     # GPU workers: the launcher's threads
    if gpu:
        env.pop("OMP_NUM_THREADS", None)
    device = [] if gpu else ["--device", "cpu"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        alone = {}
        for built in ([], ["--meta"]):
            out = tmp / f"alone{len(built)}.json"
            run([sys.executable, SCRIPT, *args.model, *built, "--out", str(out)], tmp_name,
                env | ({} if gpu else {"CUDA_VISIBLE_DEVICES": ""}))
            alone[tuple(built)] = json.loads(out.read_text())["losses"]
        rows = [row(engine, script_args, launched_gpt(engine, script_args, launch_args, args, device, tmp, env),
                    alone[tuple(script_args)]) for engine, script_args, launch_args in RUNS]
    table = ("| engine | model built | plan | parameters on | step (median s) | predicted (s) | max allocated (GiB) | "
             "max reserved (GiB) | predicted (GiB) | loss vs alone (max rel) |\n"
             "|---|---|---|---|---:|---:|---:|---:|---:|---|\n")
    table += "".join(f"| {r['engine']} | {r['built']} | {r['plan']} | {', '.join(r['parameter_devices'])} | "
                     f"{r['step_s']:.4f} | {r['predicted_s']:.4f} | {_gib(r['max_memory_allocated_bytes'])} | "
                     f"{_gib(r['max_memory_reserved_bytes'])} | "
                     f"{r['predicted_bytes'] / 2**30:.2f} | {r['loss_max_rel_diff']:.1e} "
                     f"({'equal' if r['losses_equal'] else 'DIFFERENT'}) |\n" for r in rows)
    print(table)
    notes = (f"\n{args.gpus} device(s); `examples/train_gpt.py {' '.join(args.model)}`; step time is the median over "
             f"steps after the first; losses equal means within {LOSS_RTOL:g} relative of the script run alone.\n")
    from tensoropt.profiler.run import device_name
    write_results("gpu_smoke" if gpu else "gpu_smoke_cpu", rows, table, notes,
                  {"device": torch.cuda.get_device_name(0) if gpu else device_name("cpu"), "cuda": torch.version.cuda,
                   "devices": args.gpus})
    if not all(r["losses_equal"] and r["on_device"] for r in rows):
        raise SystemExit("gpu_smoke: a run trained off the device or reached other losses (see the table)")


def row(engine: str, script_args: list[str], data: dict, reference: list[float]) -> dict:
    diff = max(abs(a - b) / abs(b) for a, b in zip(data["losses"], reference))
    return {"engine": engine, "built": "meta" if "--meta" in script_args else "host", "plan": data["plan"],
            "device": data["device"], "parameter_devices": data["parameter_devices"],
            "on_device": data["parameter_devices"] == [data["device"]],
            "step_s": statistics.median(data["step_times_s"][1:] or data["step_times_s"]),
            "predicted_s": data["predicted"]["iteration_time_s"],
            "predicted_bytes": data["predicted"]["peak_memory_bytes"],
            "max_memory_allocated_bytes": data["max_memory_allocated_bytes"],
            "max_memory_reserved_bytes": data.get("max_memory_reserved_bytes"), "loss_max_rel_diff": diff,
            "losses_equal": diff <= LOSS_RTOL}


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


if __name__ == "__main__":
    main()
