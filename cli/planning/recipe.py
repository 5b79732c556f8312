"""The Recipe: its keys and sections as frozen dataclasses (the schema's types and ranges), and what a recipe says
about itself (its properties, its techniques in words, its training method). rules.py makes one from a dict.

Keys are the words users know from transformers' TrainingArguments, peft and accelerate.
The recipe says WHAT is trained and with which memory techniques; where it runs (processes,
machines) is the Topology's business, and the generator joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import yaml

from .optimizers import OPTIMIZERS
from .rungs import LADDER
from .schema import spec, to_dict

OptimizerName = Literal[tuple(OPTIMIZERS)]  # the table's names: the schema's choices


# The fused loss's target tokens per chunk (docs/memory.md, "The fused loss's chunk"): each chunk reads the head's
# weights three times, so small chunks starve a GPU's matmuls; each holds ~8-12 bytes x tokens x vocab at once.
LOSS_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Supports:
    """The topologies a recipe runs on."""

    min_processes: int = spec(1, low=1)
    max_processes: int | None = spec(None, low=1)  # null: any number
    multi_node: bool = True
    cpu: bool = True  # runs end to end on CPU (smoke-test mode, and in the test suite); false: GPU-only


# a dataset format -> the columns that hold it (detected in this order, or named by dataset_format / columns.format)
FORMAT_COLUMNS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}


DatasetFormat = Literal[("auto", *FORMAT_COLUMNS)]  # auto: detected from the columns


@dataclass(frozen=True)
class Columns:
    """Where a format's fields come from: a column name (`completion: output`), or a template over the
    row's columns (`prompt: "{instruction}\n{input}"`). Unset: the column of that name."""

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: str | None = None  # a column name only: a conversation is a list, not text
    chosen: str | None = None  # preference pairs (run dpo): the preferred completion (or conversation)
    rejected: str | None = None  # ... and the other one


@dataclass(frozen=True)
class DataSource:
    """One dataset of a mixture."""

    path: str  # hub id, .jsonl/.json/.parquet/.csv file, or folder
    split: str = "train"  # the split of a hub dataset or folder
    fraction: float = spec(1.0, low=0, low_open=True, high=1)  # share of its rows taken, drawn with the seed
    format: DatasetFormat = "auto"  # auto: the recipe's dataset_format
    columns: Columns = field(default_factory=Columns)


@dataclass(frozen=True)
class Lora:
    r: int = spec(16, low=1, high=4096)
    alpha: float = spec(32.0, low=0, low_open=True)
    dropout: float = spec(0.05, low=0, high=0.99)
    # a list of module names, or peft's "all-linear"
    target_modules: tuple[str, ...] | Literal["all-linear"] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # whole modules trained (and saved) beside the adapters, e.g. [embed_tokens, lm_head] when tokens are added:
    # each costs a full fp32 copy with its gradients and optimizer state
    modules_to_save: tuple[str, ...] | None = None
    use_dora: bool = False  # DoRA: adds a trained magnitude per output channel (closer to a full fine-tune, slower step)
    use_rslora: bool = False  # scale by alpha / sqrt(r) instead of alpha / r (steadier at high ranks)
    # true: peft's default (B = 0); pissa / olora start from the weights' principal / orthonormal directions and
    # rewrite the base: the saved adapter is converted so that it applies to the original base
    init_lora_weights: bool | Literal["gaussian", "pissa", "olora"] = True
    bias: Literal["none", "all", "lora_only"] = "none"  # which biases train too (all: every bias of the model)
    # a saved adapter's folder to train on instead of new adapters (`--model runs/<sft-run>/final` sets it, and the
    # model to the adapter's base): r, alpha, targets, dora, rslora, bias and modules_to_save are then the adapter's
    adapter: str | None = None


@dataclass(frozen=True)
class OptimArgs:
    """Options of the optimizers that take more than AdamW's (transformers' Trainer `optim_args`)."""

    # apollo_adamw: the rank of the random projection its moments live in (state: rank x the longer side)
    rank: int = spec(128, low=1)
    proj: Literal["random", "svd"] = "random"  # random (APOLLO) or SVD (GaLore's) projection
    scale_type: Literal["channel", "tensor"] = "channel"  # the update's scaling: per channel (APOLLO) or per tensor (APOLLO-Mini)
    update_proj_gap: int = spec(200, low=1)  # steps between new projections
    scale: float = spec(1.0, low=0, low_open=True)  # the update's scale (APOLLO-Mini: sqrt(128) at rank 1)
    proj_type: Literal["std", "reverse_std", "left", "right"] = "std"
    # adamw_torch_8bit with bf16 weights: round each update stochastically to bf16, so that updates smaller
    # than half a bf16 step move the weight on average instead of being lost
    bf16_stochastic_round: bool = True


DPO_LEARNING_RATE = {"lora": 5e-6, "full": 5e-7}  # dpo.learning_rate's defaults (see Dpo.learning_rate)


@dataclass(frozen=True)
class PreferenceLoss:
    """One of the DPO family's objectives (dpo.loss_type), as PREFERENCE_LOSSES lists it."""

    source: str  # whose objective it is, and whose code the loop's follows
    # True: from the policy's log-ratios to a reference model; False: from the policy alone; None: no pair compared
    reference: bool | None
    reads: tuple[str, ...] = ()  # the dpo: keys it reads besides beta (the rules refuse them elsewhere)
    chosen_nll: bool = False  # adds the chosen completions' NLL


# The DPO family's objectives under TRL's names (trl 1.16, DPOConfig.loss_type), each computed in
# training/preference.py's PAIR_LOSSES (reference) or FREE_LOSSES (no reference); one entry adds one.
PREFERENCE_LOSSES = {
    "sigmoid": PreferenceLoss("DPO (Rafailov et al. 2023)", reference=True),
    "ipo": PreferenceLoss("IPO (Azar et al. 2023), on per-token log-ratios as TRL's", reference=True),
    "hinge": PreferenceLoss("SLiC (Zhao et al. 2023)", reference=True),
    "robust": PreferenceLoss("robust DPO (Chowdhury et al. 2024)", reference=True, reads=("label_smoothing",)),
    "simpo": PreferenceLoss("SimPO (Meng et al. 2024), trl.experimental's CPOTrainer loss_type simpo",
                            reference=False, reads=("label_smoothing", "simpo_gamma")),
    "orpo": PreferenceLoss("ORPO (Hong et al. 2024), trl.experimental's ORPOTrainer", reference=False,
                           chosen_nll=True),
    # RPO: loss_type [sigmoid, sft] with loss_weights [1, alpha]
    "sft": PreferenceLoss("the chosen completions' NLL", reference=None, chosen_nll=True),
}


DpoLoss = Literal[tuple(PREFERENCE_LOSSES)]  # type: ignore[valid-type]  (the names above)


def losses_reading(key: str) -> list[str]:
    """The loss_types that read a dpo: key."""
    return [name for name, loss in PREFERENCE_LOSSES.items() if key in loss.reads]


def losses_with(reference: bool | None) -> list[str]:
    """The loss_types by what they compare (PreferenceLoss.reference)."""
    return [name for name, loss in PREFERENCE_LOSSES.items() if loss.reference is reference]


@dataclass(frozen=True)
class Dpo:
    """Preference tuning (`memrecipe run dpo`), with TRL's DPOConfig names."""

    beta: float = spec(0.1, low=0, low_open=True)  # higher: the policy stays closer to the reference
    loss_type: DpoLoss | tuple[DpoLoss, ...] = "sigmoid"  # one objective, or a list summed with loss_weights
    loss_weights: tuple[float, ...] | None = None  # one per loss_type; null: 1 each
    label_smoothing: float = spec(0.0, low=0, high=0.49)  # robust, simpo: the share of pairs assumed mislabelled
    simpo_gamma: float | None = None  # simpo's target reward margin (TRL's CPOConfig); null: 0.5 under simpo
    # the reference's log-probabilities computed once before training and kept in the run folder (a full fine-tune
    # then needs no frozen copy of the model); null: yes for a full fine-tune, no under LoRA (its reference is
    # the same weights with the adapters off, computed beside each step); false on a full fine-tune: a frozen copy
    # of the model beside it (its weights' bytes again; sharded under FSDP and ZeRO-3)
    precompute_ref_log_probs: bool | None = None
    # tokens per sequence (prompt + completion), the start kept; a pair whose completion would be cut away entirely
    # is dropped; null: half of max_seq_length (a pair's two sequences share a packed row)
    max_length: int | None = spec(None, low=2)
    # run dpo's peak learning rate (a `learning_rate=` override under run dpo sets it); null: 5e-6 with LoRA, 5e-7 for
    # a full fine-tune (alignment-handbook's Zephyr-7B DPO recipes, QLoRA and full; TRL's DPOConfig default: 1e-6):
    # preference tuning moves a trained model a little, at SFT's rate it forgets what SFT taught
    learning_rate: float | None = spec(None, low=0, low_open=True, high=1.0)

    @property
    def losses(self) -> tuple[str, ...]:
        return (self.loss_type,) if isinstance(self.loss_type, str) else self.loss_type

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0,) * len(self.losses)

    @property
    def gamma(self) -> float:
        return 0.5 if self.simpo_gamma is None else self.simpo_gamma

    @property
    def reference_free(self) -> bool:
        """No loss compares with a reference model (simpo, orpo; with sft): no reference pass nor store."""
        return not any(PREFERENCE_LOSSES[loss].reference for loss in self.losses)

    def reads(self, key: str) -> bool:
        """Whether one of its losses reads this dpo: key (PreferenceLoss.reads)."""
        return any(key in PREFERENCE_LOSSES[loss].reads for loss in self.losses)


@dataclass(frozen=True)
class Fsdp:
    version: Literal[1, 2] = 2
    reshard_after_forward: bool = True  # True: FULL_SHARD (ZeRO-3 like); False: SHARD_GRAD_OP (ZeRO-2 like)
    activation_checkpointing: bool = False
    offload_params: bool = False
    cpu_ram_efficient_loading: bool = True
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = "FULL_STATE_DICT"
    # null: wrap the model's own decoder-layer classes (its `_no_split_modules`), read at run time
    transformer_layer_cls_to_wrap: str | None = None
    # FSDP1 only. false: flat parameters (less memory; with LoRA the adapters get their own units, as
    # PEFT's fsdp_auto_wrap_policy does); true: keep the original parameters
    use_orig_params: bool = True


@dataclass(frozen=True)
class Quantization:
    """The frozen base's weights quantized by bitsandbytes on load (transformers' BitsAndBytesConfig)."""

    bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"  # 4-bit: NF4 suits normally distributed weights
    double_quant: bool = True  # quantize the quantization constants too (~0.4 bits/param less)
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: the run's mixed precision
    quant_storage: Literal["uint8", "bf16", "fp16", "fp32"] = "bf16"  # a float type lets FSDP shard the 4-bit weights
    # true: PEFT's prepare_model_for_kbit_training, the unquantized weights (embeddings, head, norms) in fp32,
    # and so an fp32 residual stream; false: they stay in 16 bits, as torchtune keeps them
    upcast_unquantized: bool = False


@dataclass(frozen=True)
class DeepSpeed:
    zero_stage: Literal[0, 1, 2, 3] = 3
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_param: Literal["none", "cpu"] = "none"
    pin_memory: bool = True
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = spec(500_000_000, low=1)
    sub_group_size: int = spec(1_000_000_000, low=1)
    stage3_prefetch_bucket_size: int = spec(50_000_000, low=0)
    stage3_param_persistence_threshold: int = spec(100_000, low=0)
    stage3_max_live_parameters: int = spec(1_000_000_000, low=1)
    stage3_max_reuse_distance: int = spec(1_000_000_000, low=0)
    zero3_init: bool = True
    zero3_save_16bit_model: bool = True


@dataclass(frozen=True)
class RopeScaling:
    """RoPE stretched past the positions the model was trained on (transformers' rope_parameters, applied to the
    model's config as it loads: planning/positions.py)."""

    rope_type: Literal["yarn", "linear", "dynamic"] = "yarn"  # YaRN: what TRL's 1M-token example and Qwen's docs use
    factor: float | None = spec(None, low=1)  # null: max_seq_length / original_max_position_embeddings
    original_max_position_embeddings: int | None = spec(None, low=1)  # null: the model's max_position_embeddings


@dataclass(frozen=True)
class Parallelism:
    """How a layer's work is split beyond data parallelism, through accelerate's ParallelismConfig: tensor parallelism
    (FSDP2 shards over the other processes), Ulysses sequence parallelism (DeepSpeed, over the other processes) or
    ring attention (FSDP2, CUDA: torch's context_parallel)."""

    tp_size: int = spec(1, low=1)  # each layer's weights and activations split this many ways (keep within a node)
    # each sequence split this many ways (Ulysses: a process holds 1/sp of every activation but the attention's, which
    # sees the whole sequence for 1/sp of the heads); null: all the processes, one sequence-parallel group
    sp_size: int | None = spec(1, low=1)
    # each sequence split this many ways by ring attention (a process holds 1/cp of every activation; the keys and
    # values pass around the ring, all heads); FSDP2 on CUDA, sdpa, one example per row
    cp_size: int = spec(1, low=1)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    saves: str = ""  # one line for `memrecipe ls`: what memory it saves
    costs: str = ""  # one line for `memrecipe ls`: what it costs
    supports: Supports = field(default_factory=Supports)
    distributed_type: Literal["no", "ddp", "fsdp", "deepspeed"] = "no"
    # model
    model_name_or_path: str | None = None  # null: the embedded tiny default
    trust_remote_code: bool = False
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = "auto"
    # data
    # one source (hub id, file or folder; null: the embedded default dataset), or a list of
    # {path, split, fraction, format, columns} mixed together
    dataset: str | tuple[DataSource, ...] | None = None
    dataset_format: DatasetFormat = "auto"
    eval_dataset: str | tuple[DataSource, ...] | None = None
    # false: only completions / assistant turns are targets; true: every token of a document after its first
    train_on_inputs: bool = False
    chat_template: str | None = None  # null: the tokenizer's own; or a Jinja file (or the template itself)
    # fraction held out for eval when no eval_dataset is given (a given eval_dataset wins); 0 or null: none
    eval_size: float | None = spec(0.0, low=0, high=0.5)
    max_seq_length: int = spec(512, low=8)
    # null: the model's own RoPE; a section scales it past the positions the model knows (max_position_embeddings)
    rope_scaling: RopeScaling | None = None
    # whole documents packed into rows of max_seq_length (position_ids restart per document: attention never
    # crosses one); false: one example per row, padded to the longest in the batch
    packing: bool = True
    # batch and schedule
    per_device_train_batch_size: int = spec(4, low=1)
    gradient_accumulation_steps: int = spec(1, low=1)
    num_train_epochs: float = spec(1.0, low=0, low_open=True)
    max_steps: int | None = spec(None, low=1)  # overrides num_train_epochs
    learning_rate: float = spec(2e-4, low=0, low_open=True, high=1.0)
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = spec(0, low=0)
    warmup_ratio: float = spec(0.0, low=0, high=1)
    weight_decay: float = spec(0.0, low=0)
    max_grad_norm: float | None = spec(1.0, low=0, low_open=True)  # null: no clipping
    seed: int = spec(42, low=0)
    # memory techniques
    optim: OptimizerName = "adamw_torch"  # the table in planning/optimizers.py
    optim_args: OptimArgs = field(default_factory=OptimArgs)
    # the weight matrices apollo_adamw projects: module names, or all-linear (every nn.Linear, lm_head included)
    optim_target_modules: tuple[str, ...] | Literal["all-linear"] = "all-linear"
    # each parameter's update runs as soon as its gradient is complete, which is then freed (one
    # parameter's gradient is held, not the model's); no accumulation, clipping or fp16 loss scaling
    optimizer_in_backward: bool = False
    # a full fine-tune's trained weights: fp32 (master weights, autocast computes in 16 bits) or bf16 (no
    # master copy: 2 bytes/param, and updates below half a bf16 step need stochastic rounding)
    weight_dtype: Literal["fp32", "bf16"] = "fp32"
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = "auto"
    # true: each decoder layer keeps only its input and is recomputed in backward; selective: it keeps its matmuls'
    # and attention's outputs too and recomputes only the cheap ops (more memory, less recompute)
    gradient_checkpointing: bool | Literal["selective"] = False
    activation_offload: bool = False  # checkpointed layers' saved inputs wait in host memory
    # each layer's MLP runs a tile of tokens at a time, recomputed in backward: its [tokens x intermediate] tensors
    # exist one tile at a time (true: tiles of about hidden_size tokens; or a number of tiles), for one more MLP forward
    tiled_mlp: bool | int = spec(False, low=2)
    # each RMSNorm keeps its input instead of an fp32 copy and runs its backward a tile of tokens at a time (fp32
    # buffers over the whole sequence otherwise): gradients equal to rounding, for one more pass over the input
    lean_norms: bool = False
    fused_loss: bool = True  # LM head + cross-entropy chunk by chunk, recomputed in backward: no full logits
    # target tokens per chunk of the fused loss: fewer hold less ([tokens x vocab] in fp32) but re-read the head more
    loss_chunk_tokens: int = spec(LOSS_CHUNK_TOKENS, low=1)
    # each decoder layer compiled in place (one graph serves them all): faster steps after a compile on the
    # first step (tens of seconds); batches are padded to a multiple of 64 tokens to bound recompiles
    torch_compile: bool = False
    lora: Lora | None = None  # null: full fine-tune
    quantization: Quantization | None = None  # null: the base in the compute dtype; needs lora
    fsdp: Fsdp | None = None
    deepspeed: DeepSpeed | None = None
    parallelism: Parallelism | None = None  # null: neither tensor nor sequence parallelism
    dpo: Dpo | None = None  # preference tuning's keys (memrecipe run dpo); null under run sft
    # logging and saving
    logging_steps: int = spec(1, low=1)
    eval_steps: int | None = spec(None, low=1)
    save_steps: int | None = spec(None, low=1)
    save_total_limit: int | None = spec(2, low=1)
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
    # true: when the model is memrecipe's embedded tiny one, its own settings (registry.EMBEDDED_SETTINGS: the
    # learning rates that make random weights learn in seconds, 256-token rows, 3 epochs) replace the recipe's, which
    # are a real model's; key=value overrides still win. A run folder's resolved recipe says false: applied already
    embedded_settings: bool = True
    # keys of your own for a copied loop script (read as recipe.extra["my_key"]; set with extra.my_key=VALUE):
    # any YAML, checked by nothing but the script that reads it
    extra: dict = field(default_factory=dict)

    @property
    def checkpoints(self) -> bool:
        """Each decoder layer is checkpointed: by the loop (gradient_checkpointing, full or selective) or by FSDP's
        own wrapper (fsdp.activation_checkpointing)."""
        return bool(self.gradient_checkpointing or (self.fsdp and self.fsdp.activation_checkpointing))

    @property
    def tensor_parallel(self) -> int:
        """parallelism.tp_size (1: none)."""
        return self.parallelism.tp_size if self.parallelism else 1

    @property
    def sequence_parallel(self) -> int | None:
        """parallelism.sp_size (1: none; None: all the processes, decided with the topology: topology.decide)."""
        return self.parallelism.sp_size if self.parallelism else 1

    @property
    def context_parallel(self) -> int:
        """parallelism.cp_size (1: none): ring attention's group."""
        return self.parallelism.cp_size if self.parallelism else 1

    def sequence_group(self, processes: int) -> int:
        """The Ulysses group's size on this many processes: parallelism.sp_size, all of them where it is null."""
        return self.sequence_parallel or processes

    @property
    def uses_bnb(self) -> bool:
        return OPTIMIZERS[self.optim].bitsandbytes

    @property
    def low_rank(self) -> bool:
        return OPTIMIZERS[self.optim].low_rank

    @property
    def cpu_blocker(self) -> str | None:
        """Why this recipe cannot run on a machine without a GPU (each measured), or None if it can."""
        if self.tensor_parallel > 1:
            return "accelerate refuses tensor parallelism (ParallelismConfig) on CPU"
        if self.context_parallel > 1:
            return ("ring attention (parallelism.cp_size) runs on CUDA only: torch's context_parallel replaces SDPA's "
                    "CUDA kernels (flash, efficient, cudnn) and no CPU one, so each process would attend within its "
                    "own slice; zero3-ulysses splits sequences on CPU")
        if self.fsdp and self.fsdp.version == 1:
            return "FSDP1 wants a CUDA compute device (torch: inconsistent compute device cpu vs cpu:0)"
        if self.fsdp and self.fsdp.offload_params:
            return "FSDP parameter offload needs an accelerator to fetch the parameters to"
        if self.attn_implementation in ("flash_attention_2", "flex_attention"):
            return (f"attn_implementation={self.attn_implementation} trains on CUDA only (flash-attn is a CUDA "
                    "package; torch 2.13's flex_attention has no backward on CPU); attn_implementation=auto runs sdpa "
                    "here")
        if not self.supports.cpu:
            return "the recipe says supports.cpu: false"
        return None

    @property
    def fp16_blocker(self) -> str | None:
        """Why this recipe cannot train in fp16 (None: it can). Read wherever the precision is decided: the recipe's
        own mixed_precision, `auto` on a GPU without bf16 (topology.check_supported), a launch config's (the loop)."""
        if self.weight_dtype == "bf16":
            return "weight_dtype bf16 computes in bf16 (bf16 weights have no fp32 master for fp16's loss scaling)"
        if self.optimizer_in_backward:
            return ("optimizer_in_backward cannot use fp16's loss scaler: it skips or rescales a whole step once every "
                    "gradient is seen, and each parameter is already updated by then")
        return None

    @property
    def script(self) -> str:
        """The loop script that trains this recipe once resolved (a run folder's): dpo where it has a dpo: section."""
        return "dpo" if self.dpo is not None else "sft"

    @property
    def dpo_reference(self) -> str | None:
        """Where run dpo's reference log-probs come from (None without a dpo: section): "none" (a reference-free
        loss), "store" (precomputed before the first step: a full fine-tune's default), "copy" (a frozen copy of the
        whole model: a full fine-tune with precompute_ref_log_probs false), "adapter" (a saved adapter's frozen copy,
        beside each micro batch) or "adapters-off" (LoRA's default)."""
        d = self.dpo
        if d is None:
            return None
        if d.reference_free:
            return "none"
        if d.precompute_ref_log_probs if d.precompute_ref_log_probs is not None else self.lora is None:
            return "store"
        if self.lora is None:
            return "copy"
        return "adapter" if self.lora.adapter else "adapters-off"

    def to_dict(self) -> dict:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def techniques(r: Recipe) -> list[str]:
    """The memory techniques a recipe uses, in words for tables."""
    out = []
    if r.tensor_parallel > 1:
        out.append(f"tensor parallel x{r.tensor_parallel}")
    if r.sequence_parallel != 1:
        out.append("Ulysses sequence parallelism " + (f"x{r.sequence_parallel}" if r.sequence_parallel else
                                                      "over all the processes"))
    if r.context_parallel > 1:
        out.append(f"ring attention x{r.context_parallel}")
    if r.fsdp:
        shard = "full shard" if r.fsdp.reshard_after_forward else "shard grad+optim"
        out.append(f"FSDP{r.fsdp.version} {shard}")
        if r.fsdp.offload_params:
            out.append("FSDP CPU offload")
        if r.fsdp.activation_checkpointing:
            out.append("activation checkpointing")
    if r.deepspeed:
        out.append(f"ZeRO-{r.deepspeed.zero_stage}")
        offloaded = [k for k, v in (("optimizer", r.deepspeed.offload_optimizer), ("params", r.deepspeed.offload_param))
                     if v != "none"]
        if offloaded:
            out.append(f"{' + '.join(offloaded)} offload to CPU")
    if r.distributed_type == "ddp":
        out.append("DDP")
    if r.quantization:
        q = r.quantization
        out.append(f"{q.quant_type.upper() if q.bits == 4 else 'int8'} base{' (double quant)' if q.double_quant and q.bits == 4 else ''}")
    if r.lora:
        targets = r.lora.target_modules if isinstance(r.lora.target_modules, str) else ",".join(r.lora.target_modules)
        kind = "DoRA" if r.lora.use_dora else "LoRA"
        init = f", {r.lora.init_lora_weights} init" if isinstance(r.lora.init_lora_weights, str) else ""
        saved = f" + {','.join(r.lora.modules_to_save)}" if r.lora.modules_to_save else ""
        out.append(f"{kind} r={r.lora.r} ({targets}{saved}{init})")
    else:
        out.append("full fine-tune")
    out += [said for rung in LADDER if (said := rung.said(r))]  # the activation ladder's rungs it stands on
    out.append({"auto": "bf16/fp16 auto", "no": "fp32"}.get(r.mixed_precision, r.mixed_precision))
    if r.weight_dtype == "bf16":
        out.append("bf16 weights" + (", stochastic rounding" if r.optim == "adamw_torch_8bit"
                                     and r.optim_args.bf16_stochastic_round else ""))
    if r.optim != "adamw_torch":
        out.append(OPTIMIZERS[r.optim].label + (f" rank {r.optim_args.rank}" if r.low_rank else ""))
    if r.optimizer_in_backward:
        out.append("optimizer step in backward")
    if r.torch_compile:
        out.append("torch.compile per layer")
    return out


METHODS = {"full": "full fine-tune", "lora": "LoRA", "qlora": "QLoRA"}


def method(recipe: Recipe) -> str:
    """What trains: the whole model (full), adapters on a 16-bit base (lora), or on a quantized one (qlora).
    A choice of quality, not of speed: recommendations stay within one."""
    return "qlora" if recipe.quantization else "lora" if recipe.lora else "full"


def processes_range(r: Recipe) -> str:
    s = r.supports
    if s.max_processes == s.min_processes:
        span = f"{s.min_processes}"
    elif s.max_processes is None:
        span = f"{s.min_processes}+"
    else:
        span = f"{s.min_processes}-{s.max_processes}"
    return span + (", multi-node" if s.multi_node and s.max_processes != 1 else "")
