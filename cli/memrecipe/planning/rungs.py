"""The activation ladder's rungs as one table, cheapest first: each is what a recipe gives up to train a longer
sequence (docs/long-context.md). Every part of a rung is in its entry: when a recipe uses it and the words that climb
to it (planning/ladder.py), the rules it needs (rules.py runs them), the planner's term for it (activations.py), the
module whose `apply` the loop runs for it (training/rungs.py climbs them), its words in the start-up line and in
`memrecipe ls` (Recipe's techniques()). A new rung is one entry here plus its own module; a test fails when an entry
lacks a part (tests/unit/planning/test_rungs.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RecipeError

# (the Recipe, the Topology and the setup facts go unnamed here: recipe.py reads this table, and an import back
# would be a circle)


@dataclass(frozen=True)
class Technique:
    """One rung of the ladder: what a recipe gives up on it."""

    name: str  # as docs/long-context.md and `plan` name it
    on: Callable[..., bool]  # (recipe, processes or None): whether a recipe uses it
    # (recipe, topology or None): whether a recipe below climbs to it; (recipe, topology, the rung below's words):
    # the words that do
    offered: Callable[..., bool]
    words: Callable[..., tuple[str, ...]]
    said: Callable[..., str | None] = lambda r: None  # (recipe): its words among a recipe's techniques (`memrecipe ls`)
    check: Callable[..., None] = lambda r: None  # (recipe): its rules, a RecipeError naming the fix where refused
    term: str = ""  # the function of planning/activations.py that counts what it keeps or frees
    # the module of memrecipe.training whose apply(model, recipe, accelerator) the loop runs for it ("": none, `why`
    # says what applies it), and whether that runs after the LoRA adapters are added (what it wraps includes them)
    hook: str = ""
    after_adapters: bool = False
    why: str = ""
    phrase: Callable[..., str | None] = lambda facts, r: None  # (setup facts, recipe): its words in the start-up line


def _check_offload(r) -> None:
    if r.activation_offload and not r.gradient_checkpointing:  # (the fix comes first: plan's table cuts at the colon)
        fsdp = ", fsdp.activation_checkpointing=false" if r.fsdp and r.fsdp.activation_checkpointing else ""
        cannot = "; FSDP's own checkpointing cannot" if fsdp else ""
        raise RecipeError(f"activation_offload works with gradient_checkpointing=true{fsdp} (it moves the inputs that "
                          f"checkpointing keeps to host RAM{cannot}): set gradient_checkpointing=true"
                          f"{fsdp.replace(',', '')}")
    if r.activation_offload and r.gradient_checkpointing == "selective":
        raise RecipeError("activation_offload moves the layer inputs that full checkpointing keeps to host RAM, and "
                          "gradient_checkpointing: selective keeps more on the GPU to recompute less: use "
                          "gradient_checkpointing=true with the offload, or selective without it")


def _check_tiled_mlp(r) -> None:
    if r.tiled_mlp is not False and r.distributed_type == "fsdp":
        raise RecipeError("tiled_mlp runs on one process or under DeepSpeed (told to wait for a weight's last tile): "
                          "FSDP syncs each weight's gradient once, and the tiles give it in parts: set tiled_mlp=false")
    if r.tiled_mlp is not False and (r.optimizer_in_backward or r.torch_compile):
        raise RecipeError("tiled_mlp gives each weight its gradient in parts, tile by tile: optimizer_in_backward "
                          "steps at the first, and torch_compile traces a layer whole: set tiled_mlp=false or "
                          f"{'optimizer_in_backward' if r.optimizer_in_backward else 'torch_compile'}=false")


def _check_lean_norms(r) -> None:
    if r.lean_norms and (r.torch_compile or r.tensor_parallel > 1):
        raise RecipeError("lean_norms replaces each RMSNorm's forward: torch_compile fuses the norm its own way, and "
                          "under tensor parallelism it is not checked yet: set lean_norms=false or "
                          f"{'torch_compile=false' if r.torch_compile else 'parallelism=null'}")


def _check_query_chunks(r) -> None:
    if r.query_chunks is False:
        return
    if r.attn_implementation != "sdpa":
        raise RecipeError("query_chunks runs sdpa's kernel a chunk of queries a call (flash_attention_2 and "
                          "flex_attention have their own long-context paths): set attn_implementation=sdpa")
    if r.packing:
        raise RecipeError("query_chunks runs rows without a mask, and a packed row carries one under sdpa: "
                          "set packing=false")
    if r.context_parallel > 1:
        raise RecipeError("query_chunks runs whole sequences (one process's, or under Ulysses each process's share of "
                          "the heads); ring attention passes each process a slice of the keys: set query_chunks=false")
    if r.torch_compile or r.tensor_parallel > 1:
        raise RecipeError("query_chunks calls the kernel once a chunk, and torch_compile traces a layer whole (under "
                          "tensor parallelism it is not checked yet): set query_chunks=false or "
                          f"{'torch_compile=false' if r.torch_compile else 'parallelism=null'}")


def _chunk_words(r, topo, below) -> tuple[str, ...]:
    sdpa = ("attn_implementation=sdpa",) if r.attn_implementation == "auto" else ()
    unpacked = ("packing=false",) if r.packing and "packing=false" not in below else ()  # (sequence parallelism's)
    return (*below, *sdpa, *unpacked, "query_chunks=true")


def _full_phrase(facts, r) -> str | None:
    if facts.gradient_checkpointing is True:
        return "full checkpointing (each layer keeps its input)"
    if facts.engine_checkpointed_layers:  # FSDP's own wrapper (fsdp.activation_checkpointing)
        return f"full checkpointing by the engine's wrapper ({facts.engine_checkpointed_layers} layers keep their inputs)"
    return None


def _lean_phrase(facts, r) -> str | None:
    if facts.lean_norms:
        return f"{facts.lean_norms} RMSNorms keep their inputs, not fp32 copies"
    return "lean_norms: none of this model's norms is Llama's RMSNorm, each left as it is" if r.lean_norms else None


def _offload_words(r, topo, below) -> tuple[str, ...]:
    """The loop's own checkpointing (FSDP's wrapper keeps its inputs on the GPU), its inputs in host RAM."""
    ours = () if r.gradient_checkpointing is True else ("gradient_checkpointing=true",)
    fsdp = ("fsdp.activation_checkpointing=false",) if r.fsdp and r.fsdp.activation_checkpointing else ()
    return (*ours, *fsdp, "activation_offload=true")


def _split_words(r, topo, below) -> tuple[str, ...]:
    unpacked = ("packing=false",) if r.packing and r.attn_implementation != "flash_attention_2" else ()
    return (*below, *unpacked, f"parallelism.sp_size={topo.num_processes}")


LADDER = (
    Technique("no checkpointing", on=lambda r, n: True, offered=lambda r, topo: False, words=lambda r, topo, below: (),
              term="layer_activation_bytes", why="every activation kept: nothing to apply",
              phrase=lambda f, r: "every one kept" if f.gradient_checkpointing is False
              and not f.engine_checkpointed_layers else None),
    # the matmuls' and attention's outputs kept, the cheap ops recomputed
    Technique("selective checkpointing", on=lambda r, n: r.gradient_checkpointing == "selective",
              offered=lambda r, topo: not r.checkpoints,
              words=lambda r, topo, below: ("gradient_checkpointing=selective",),
              said=lambda r: "selective checkpointing" if r.gradient_checkpointing == "selective" else None,
              term="selective_bytes", hook="layers",
              phrase=lambda f, r: "selective checkpointing (each layer keeps its matmuls' and attention's outputs)"
              if f.gradient_checkpointing == "selective" else None),
    # each layer's input kept (the loop's, or FSDP's own wrapper)
    Technique("full checkpointing", on=lambda r, n: r.recomputes,
              offered=lambda r, topo: not r.recomputes,
              words=lambda r, topo, below: ("gradient_checkpointing=true",),
              said=lambda r: "gradient checkpointing" if r.gradient_checkpointing is True else None,
              term="activation_bytes", hook="layers", phrase=_full_phrase),
    # that input in host RAM
    Technique("activation offload", on=lambda r, n: r.activation_offload,
              offered=lambda r, topo: not r.activation_offload, words=_offload_words,
              said=lambda r: "activation offload to host" if r.activation_offload else None,
              check=_check_offload, term="activation_bytes", hook="layers",
              phrase=lambda f, r: "their inputs in host RAM" if r.activation_offload else None),
    # each RMSNorm's input kept as it comes, its backward a tile of tokens at a time
    Technique("lean norms", on=lambda r, n: r.lean_norms, offered=lambda r, topo: not r.lean_norms,
              words=lambda r, topo, below: (*below, "lean_norms=true"),
              said=lambda r: "lean norms" if r.lean_norms else None,
              check=_check_lean_norms, term="lean_norm_saving", hook="norms", after_adapters=True, phrase=_lean_phrase),
    # each MLP's tensors one tile of tokens at a time (one process only: the rules say where)
    Technique("tiled MLP", on=lambda r, n: r.tiled_mlp is not False, offered=lambda r, topo: r.tiled_mlp is False,
              words=lambda r, topo, below: (*below, "tiled_mlp=true"),
              said=lambda r: "tiled MLP" if r.tiled_mlp is not False else None,
              # (after the adapters: under DeepSpeed it waits for each trainable weight's last tile, LoRA's included)
              check=_check_tiled_mlp, term="mlp_bytes", hook="tiling", after_adapters=True,
              phrase=lambda f, r: f"{f.tiled_mlps} MLPs run in tiles of tokens, recomputed in backward"
              if f.tiled_mlps else None),
    # each sequence split over every process (Ulysses: each holds 1/N of it; ZeRO-3 only); over one, nothing is split
    Technique("sequence parallelism",
              on=lambda r, n: r.sequence_parallel != 1 and (n is None or r.sequence_group(n) > 1),
              offered=lambda r, topo: topo is not None and topo.num_processes > 1 and r.sequence_parallel == 1,
              words=_split_words,  # (techniques names it with its group; the parallelism rules check it)
              term="exchange_bytes", why="accelerate's prepare registers DeepSpeed's Ulysses attention; the loop's "
              "Collator pads each row to a multiple of the group",
              phrase=lambda f, r: f"each sequence split over {f.sequence_parallel} processes"
              if f.sequence_parallel > 1 else None),
    # sdpa's attention a chunk of queries a call, on rows without a mask: its backward's buffers over a chunk of
    # queries and one of keys, its offsets within 32 bits (from auto too: sdpa's kernel in chunks holds less than
    # flash-attn's or flex_attention's whole)
    Technique("query chunks", on=lambda r, n: r.query_chunks is not False,
              offered=lambda r, topo: r.attn_implementation in ("auto", "sdpa") and r.query_chunks is False,
              words=_chunk_words, said=lambda r: "attention in query chunks" if r.query_chunks is not False else None,
              check=_check_query_chunks, term="attention_backward_bytes", hook="query_chunks",
              phrase=lambda f, r: f"attention {f.query_chunk:,} queries a call in rows without a mask"
              if f.query_chunk else None),
)


def checks(r) -> None:
    """Every rung's rules (rules.py runs them with the recipe's others)."""
    for technique in LADDER:
        technique.check(r)
