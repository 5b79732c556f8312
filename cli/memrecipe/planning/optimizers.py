"""The optimizers a recipe can name (`optim`), each described once: read by the recipe's schema and checks,
`memrecipe ls`, the planner (state bytes, step cost) and the loop's factory (memrecipe.training.optimizers).
Adding an optimizer is one entry here and one builder there."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("no", "ddp", "fsdp", "deepspeed")  # a recipe's distributed_type


@dataclass(frozen=True)
class Optimizer:
    label: str  # in `memrecipe ls` and the card
    builder: str  # its function in memrecipe.training.optimizers: (recipe, device) -> (groups -> optimizer)
    state: str  # how the planner counts its state (states.optimizer_state_bytes): adamw, bnb_8bit, torchao_8bit, low_rank
    engines: tuple[str, ...] = ENGINES  # the distributed types it runs under
    why_not: str = ""  # why not under the others
    bitsandbytes: bool = False  # its state is bitsandbytes' (no DTensor: not FSDP2; not beside DeepSpeed's CPU Adam)
    bf16_rounding: str = "to nearest"  # how it writes an update into bf16 weights (weight_dtype: bf16)
    first_use_on_cuda: str = ""  # said before step 1 on a GPU: what its first use costs

    @property
    def eight_bit(self) -> bool:
        """8-bit moments; embeddings keep 32-bit state (training.optimizers.EMBEDDING_BITS)."""
        return self.state in ("bnb_8bit", "torchao_8bit")

    @property
    def low_rank(self) -> bool:
        """Moments in low-rank projections of the weight matrices optim_target_modules names."""
        return self.state == "low_rank"


SHARDED = "is not tested under an engine that shards the optimizer state in memrecipe"
TORCHAO_COMPILE = ("torchao compiles its step with torch.compile, one graph per kind of parameter (shape, dtype; ~7 "
                   "for a Llama; torchao measured ~12 minutes on a 7B): compiled before step 1. optim=adamw_bnb_8bit "
                   "needs no compile, but rounds bf16 updates to nearest (benchmarks/bf16_rounding.py)")

OPTIMIZERS = {
    "adamw_torch": Optimizer("AdamW", "torch_adamw", "adamw"),
    "adamw_bnb_8bit": Optimizer("8-bit AdamW", "bnb_8bit", "bnb_8bit", bitsandbytes=True),
    "paged_adamw_8bit": Optimizer("8-bit AdamW (paged on CUDA)", "bnb_8bit", "bnb_8bit", bitsandbytes=True),
    # 8-bit moments and, with bf16 weights, stochastic rounding of each update (optim_args.bf16_stochastic_round)
    "adamw_torch_8bit": Optimizer("8-bit AdamW (torchao)", "torchao_8bit", "torchao_8bit", ("no", "ddp"), SHARDED,
                                  bf16_rounding="stochastically",
                                  # torchao/optim/adam.py: torch.compile(single_param_adam, fullgraph=True,
                                  # dynamic=False), called per parameter: a graph per shape and dtype
                                  first_use_on_cuda=TORCHAO_COMPILE),
    "apollo_adamw": Optimizer("APOLLO", "apollo", "low_rank", ("no", "ddp"),
                              "projects each weight matrix whole, and the engine hands the optimizer flat or row shards"),
}


def bf16_rounding(recipe) -> str | None:
    """How this recipe's optimizer writes its updates into bf16 weights: 'stochastically' or 'to nearest' (an update
    below half a bf16 step is lost); None when no bf16 weight trains."""
    if recipe.weight_dtype != "bf16" or recipe.lora is not None:
        return None
    if recipe.optim == "adamw_torch_8bit" and not recipe.optim_args.bf16_stochastic_round:
        return "to nearest"
    return OPTIMIZERS[recipe.optim].bf16_rounding
