"""The file the workers read: plan.json as one typed, frozen value.

The launcher writes plan.json with ``RunPlan.to_json`` and every worker reads it back once, in
``tensoropt.parallelize`` (``RunPlan.read``); the runtime then uses attributes, never string keys. A
``RunPlan`` is the planner's ``Plan`` plus what the launcher adds for the workers:

- ``engine``: which engine runs it (``ENGINES``; "" in a hand-written file: the runtime chooses);
- ``device``: the kind of device it was made for (``DEVICE_KINDS``; "": where this process would train);
- ``tp_layout``: for a tensor-parallel plan, which linears of each block are column- and row-parallel
  (``space.tp_layout``, from the same block analysis the cost model prices);
- ``vocab_parallel``: whether the vocabulary is split over tp and which modules hold it (``space.vocab``);
- ``lean_loss``: the model's loss runs on the runtime's lean cross-entropy, split or whole, as it was priced
  (``space.vocab.VocabLayout.fused_loss``; written when true, absent: torch's);
- ``deepspeed_config``: the path of the exact DeepSpeed config written beside it (DeepSpeed plans);
- ``predicted`` and ``command``: what the launcher predicted and how it was started (for the reader, and
  for ``TENSOROPT_SIMULATED_MEMORY_BYTES``).

The JSON keys are a contract with files already written (``--plan`` reuses them): ``to_json`` writes the keys
and the order the launcher has always written, ``from_json`` reads them back to an equal value
(``from_json(x).to_json() == x`` for every file the launcher writes), and a field of the wrong type or value,
or a key it does not know, is a one-line ``TensorOptError`` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TensorOptError
from . import fields as F
from .plan import Plan
from .tp_layout import TP_LAYOUT_KEY
from .vocab import VOCAB_PARALLEL_KEY

LEAN_LOSS_KEY = "lean_loss"

ENGINES = ("torch", "deepspeed")          # in order of preference when both run a plan (``search.engines``)
DEVICE_KINDS = ("cuda", "cpu")
# what ``Plan.to_json`` writes (``Plan.from_json`` reads them), then the launcher's additions in their order
PLAN_KEYS = ("schema_version", "devices", "dp", "tp", "pp", "virtual_stages", "micro_batch", "global_batch",
             "gradient_accumulation", "zero", "offload", "tp_branches", "dtype", "master_weights", "blocks", "summary",
             "precision", "compile", "grad_dtype", "cp", "ep")
EXTRA_KEYS = ("engine", "device", TP_LAYOUT_KEY, VOCAB_PARALLEL_KEY, LEAN_LOSS_KEY, "deepspeed_config", "predicted",
              "command")


@dataclass(frozen=True)
class TPBranch:
    """One tensor-parallel branch of a block (``space.tp_layout``): module names relative to a block copy."""

    branch: str                           # the planner's branch name (``Plan.tp_branches``)
    column: tuple[str, ...]               # linears split by output features
    row: tuple[str, ...]                  # linears split by input features
    max_tp: int                           # every tensor-parallel degree must divide it (heads, features)
    segments: tuple[tuple[str, tuple[int, ...]], ...] = ()   # fused column linears: their segments' sizes

    def segments_of(self, module: str) -> tuple[int, ...] | None:
        """The segment sizes of column linear ``module`` if it is fused, else None."""
        return dict(self.segments).get(module)

    @property
    def linears(self) -> tuple[str, ...]:
        return self.column + self.row

    def to_json(self) -> dict[str, Any]:
        out = {"branch": self.branch, "column": list(self.column), "row": list(self.row), "max_tp": self.max_tp}
        return out | ({"segments": {name: list(sizes) for name, sizes in self.segments}} if self.segments else {})

    @staticmethod
    def from_json(d: dict[str, Any], where: str) -> TPBranch:
        F.only(d, ("branch", "column", "row", "max_tp", "segments"), where)
        segments = F.mapping(d, "segments", {}, where)
        return TPBranch(F.text(d, "branch", where=where), F.strings(d, "column", where=where),
                        F.strings(d, "row", where=where), F.integer(d, "max_tp", minimum=1, where=where),
                        tuple((name, F.integers(segments, name, where=f"{where}.segments")) for name in segments))


Branches = tuple[TPBranch, ...]
TPLayout = tuple[tuple[str, Branches], ...]     # (block pattern, its branches), in the file's order


def tp_layout_from_json(d: dict[str, Any]) -> TPLayout:
    """plan.json's ``tp_layout`` ({block pattern: [branch, ...]}) as a typed, immutable layout."""
    if not isinstance(d, dict):
        raise ValueError(f"field {TP_LAYOUT_KEY!r} must be an object, got {d!r}")
    return tuple((block, tuple(TPBranch.from_json(b, f"{TP_LAYOUT_KEY}.{block}[{i}]")
                               for i, b in enumerate(F.objects(d, block, where=TP_LAYOUT_KEY)))) for block in d)


@dataclass(frozen=True)
class VocabSplit:
    """plan.json's ``vocab_parallel`` (``VocabLayout.for_tp``): the modules holding the vocabulary when it is split
    over tp, else why it stays replicated."""

    enabled: bool
    reason: str = ""                      # why not (disabled only)
    embedding: str = ""                   # module path of the nn.Embedding (enabled only)
    head: str = ""                        # module path of the nn.Linear producing the logits
    tied: bool = False                    # the head reads the embedding's weight
    vocab: int = 0

    def to_json(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False, "reason": self.reason}
        return {"enabled": True, "embedding": self.embedding, "head": self.head, "tied": self.tied,
                "vocab": self.vocab}

    @staticmethod
    def from_json(d: dict[str, Any]) -> VocabSplit:
        where = VOCAB_PARALLEL_KEY
        if not F.boolean(d, "enabled", where=where):
            F.only(d, ("enabled", "reason"), where)
            return VocabSplit(False, reason=F.text(d, "reason", "", where=where))
        F.only(d, ("enabled", "embedding", "head", "tied", "vocab"), where)
        return VocabSplit(True, embedding=F.text(d, "embedding", where=where), head=F.text(d, "head", where=where),
                          tied=F.boolean(d, "tied", where=where), vocab=F.integer(d, "vocab", minimum=1, where=where))


@dataclass(frozen=True)
class Prediction:
    """What the launcher predicted for the plan, in words and figures (plan.json's ``predicted``)."""

    iteration_time_s: float
    peak_memory_bytes: int
    precision: str                        # in words (``launcher.launch.precision``)
    why: str                              # why this plan was chosen

    def to_json(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time_s, "peak_memory_bytes": self.peak_memory_bytes,
                "precision": self.precision, "why": self.why}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Prediction:
        where = "predicted"
        F.only(d, ("iteration_time_s", "peak_memory_bytes", "precision", "why"), where)
        return Prediction(F.number(d, "iteration_time_s", where=where), F.integer(d, "peak_memory_bytes", where=where),
                          F.text(d, "precision", "", where=where), F.text(d, "why", "", where=where))


@dataclass(frozen=True)
class RunPlan:
    """plan.json: the plan and what the workers need besides it (module doc). Frozen; checked on construction."""

    plan: Plan
    engine: str = ""
    device: str = ""
    tp_layout: TPLayout | None = None     # None: the file has none (a plan without tensor parallelism)
    vocab_parallel: VocabSplit | None = None
    lean_loss: bool = False               # the loss runs on the runtime's lean cross-entropy (module doc)
    deepspeed_config: str | None = None
    predicted: Prediction | None = None
    command: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.engine not in ("", *ENGINES):
            raise TensorOptError(f"plan engine {self.engine!r} is unknown: use one of {', '.join(ENGINES)}")
        if self.device not in ("", *DEVICE_KINDS):
            raise TensorOptError(f"plan device {self.device!r} is unknown: use one of {', '.join(DEVICE_KINDS)}")

    def summary(self) -> str:
        return self.plan.summary()

    def layout_of(self, block: str) -> Branches:
        """Every branch of ``block`` that the tensor-parallel layout names (sharded or not)."""
        return dict(self.tp_layout or ()).get(block, ())

    def to_json(self) -> dict[str, Any]:
        """plan.json, with the keys in the order the launcher writes them (module doc)."""
        extra: dict[str, Any] = {"engine": self.engine, "device": self.device}
        extra = {k: v for k, v in extra.items() if v}
        if self.tp_layout is not None:
            extra[TP_LAYOUT_KEY] = {block: [b.to_json() for b in branches] for block, branches in self.tp_layout}
        if self.vocab_parallel is not None:
            extra[VOCAB_PARALLEL_KEY] = self.vocab_parallel.to_json()
        if self.lean_loss:
            extra[LEAN_LOSS_KEY] = True
        if self.deepspeed_config is not None:
            extra["deepspeed_config"] = self.deepspeed_config
        if self.predicted is not None:
            extra["predicted"] = self.predicted.to_json()
        if self.command is not None:
            extra["command"] = list(self.command)
        return self.plan.to_json() | extra

    @staticmethod
    def from_json(d: dict[str, Any], source: str = "plan.json") -> RunPlan:
        """The plan.json ``d`` read from ``source`` (named in the one-line error a bad field gives)."""
        try:
            F.only(d, PLAN_KEYS + EXTRA_KEYS)
            config = d.get("deepspeed_config")
            if config is not None and not isinstance(config, str):
                raise ValueError(f"field 'deepspeed_config' must be a path, got {config!r}")
            return RunPlan(
                Plan.from_json(d), engine=F.text(d, "engine", ""), device=F.text(d, "device", ""),
                tp_layout=tp_layout_from_json(d[TP_LAYOUT_KEY]) if TP_LAYOUT_KEY in d else None,
                vocab_parallel=VocabSplit.from_json(F.mapping(d, VOCAB_PARALLEL_KEY)) if VOCAB_PARALLEL_KEY in d
                else None, lean_loss=F.boolean(d, LEAN_LOSS_KEY, False), deepspeed_config=config,
                predicted=Prediction.from_json(F.mapping(d, "predicted")) if "predicted" in d else None,
                command=F.strings(d, "command") if "command" in d else None)
        except ValueError as exc:
            raise TensorOptError(f"{source}: {exc}") from None
        except TensorOptError as exc:
            raise TensorOptError(f"{source}: {exc}") from None

    @staticmethod
    def read(path: str | Path) -> RunPlan:
        """plan.json at ``path``; an unreadable or invalid file is a one-line error naming it."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise TensorOptError(f"{path}: not a readable plan file ({exc})") from None
        return RunPlan.from_json(data, str(path))


__all__ = ["Branches", "DEVICE_KINDS", "ENGINES", "LEAN_LOSS_KEY", "Prediction", "RunPlan", "TPBranch", "TPLayout",
           "VocabSplit", "tp_layout_from_json"]
