"""The activation ladder's rungs as one table, cheapest first: each is what a recipe gives up to train a longer
sequence (docs/long-context.md). planning/ladder.py climbs them, Recipe's techniques() names them (`memrecipe ls`);
a new rung is one entry here, with its rules (rules.py), its planner term (activations.py), its training module and
its hook in the loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# (the Recipe and the Topology go unnamed here: recipe.py reads this table, and an import back would be a circle)


@dataclass(frozen=True)
class Technique:
    """One rung of the ladder: what a recipe gives up on it. LADDER lists them cheapest first; a new rung is one
    entry (with its rules in rules.py, its planner term in activations.py and its training module)."""

    name: str
    on: Callable[..., bool]  # (recipe, processes or None): whether a recipe uses it
    # (recipe, topology or None): whether a recipe below climbs to it; (recipe, topology, the rung below's words):
    # the words that do
    offered: Callable[..., bool]
    words: Callable[..., tuple[str, ...]]
    said: Callable[..., str | None] = lambda r: None  # (recipe): its words among a recipe's techniques (`memrecipe ls`)


def _offload_words(r, topo, below) -> tuple[str, ...]:
    """The loop's own checkpointing (FSDP's wrapper keeps its inputs on the GPU), its inputs in host RAM."""
    ours = () if r.gradient_checkpointing is True else ("gradient_checkpointing=true",)
    fsdp = ("fsdp.activation_checkpointing=false",) if r.fsdp and r.fsdp.activation_checkpointing else ()
    return (*ours, *fsdp, "activation_offload=true")


def _split_words(r, topo, below) -> tuple[str, ...]:
    unpacked = ("packing=false",) if r.packing and r.attn_implementation != "flash_attention_2" else ()
    return (*below, *unpacked, f"parallelism.sp_size={topo.num_processes}")


LADDER = (
    Technique("no checkpointing", on=lambda r, n: True, offered=lambda r, topo: False, words=lambda r, topo, below: ()),
    # the matmuls' and attention's outputs kept, the cheap ops recomputed
    Technique("selective checkpointing", on=lambda r, n: r.gradient_checkpointing == "selective",
              offered=lambda r, topo: not r.checkpoints,
              words=lambda r, topo, below: ("gradient_checkpointing=selective",),
              said=lambda r: "selective checkpointing" if r.gradient_checkpointing == "selective" else None),
    # each layer's input kept (the loop's, or FSDP's own wrapper)
    Technique("full checkpointing", on=lambda r, n: r.checkpoints and r.gradient_checkpointing != "selective",
              offered=lambda r, topo: not r.checkpoints or r.gradient_checkpointing == "selective",
              words=lambda r, topo, below: ("gradient_checkpointing=true",),
              said=lambda r: "gradient checkpointing" if r.gradient_checkpointing is True else None),
    # that input in host RAM
    Technique("activation offload", on=lambda r, n: r.activation_offload,
              offered=lambda r, topo: not r.activation_offload, words=_offload_words,
              said=lambda r: "activation offload to host" if r.activation_offload else None),
    # each RMSNorm's input kept as it comes, its backward a tile of tokens at a time
    Technique("lean norms", on=lambda r, n: r.lean_norms, offered=lambda r, topo: not r.lean_norms,
              words=lambda r, topo, below: (*below, "lean_norms=true"),
              said=lambda r: "lean norms" if r.lean_norms else None),
    # each MLP's tensors one tile of tokens at a time (one process only: the rules say where)
    Technique("tiled MLP", on=lambda r, n: r.tiled_mlp is not False, offered=lambda r, topo: r.tiled_mlp is False,
              words=lambda r, topo, below: (*below, "tiled_mlp=true"),
              said=lambda r: "tiled MLP" if r.tiled_mlp is not False else None),
    # each sequence split over every process (Ulysses: each holds 1/N of it; ZeRO-3 only); over one, nothing is split
    Technique("sequence parallelism",
              on=lambda r, n: r.sequence_parallel != 1 and (n is None or r.sequence_group(n) > 1),
              offered=lambda r, topo: topo is not None and topo.num_processes > 1 and r.sequence_parallel == 1,
              words=_split_words),  # (techniques names it with its group)
)
