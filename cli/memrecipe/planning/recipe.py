"""The Recipe: its keys and sections as frozen dataclasses (the schema's types and ranges), and what a recipe says
about itself (its properties, its techniques in words, its training method). rules.py makes one from a dict.

Keys are the words users know from transformers' TrainingArguments, peft and accelerate.
The recipe says WHAT is trained and with which memory techniques; where it runs (processes,
machines) is the Topology's business, and the generator joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import yaml

from .optimizers import OPTIMIZERS
from .rungs import LADDER
from .schema import spec, to_dict

# The tables' names as Literals, the schema's choices (made at run time: to pyright they are str)
if TYPE_CHECKING:
    OptimizerName = str
else:
    OptimizerName = Literal[tuple(OPTIMIZERS)]


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


if TYPE_CHECKING:
    DatasetFormat = str
else:
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
    r: int = spec(16, low=1, high=4096, shown='16, 32, 0.05', keys='`r`, `alpha`, `dropout`',
        help="rank, scale (alpha / r), dropout on the adapter's input")
    alpha: float = spec(32.0, low=0, low_open=True, row=False)
    dropout: float = spec(0.05, low=0, high=0.99, row=False)
    # dropout's mask drawn again in backward, under autocast: each adapter keeps only its input, shared with its
    # siblings (less memory in a recomputed layer, the binding place at long context), for one more pass of its cast
    # and dropout and a checkpoint of its own (host time in a launch-bound step); `auto` (planner.decide_dropout):
    # peft's where the run fits that way, the redraw where only it fits
    redraw_dropout: bool | Literal["auto"] = spec("auto", shown='`auto`',
        help=("`true`: in 16 bits (autocast, or DeepSpeed's engine) each adapter redraws its dropout mask in backward "
              "and keeps only its input (shared by q/k/v and by gate/up); `false`: peft's dropout, each adapter keeping "
              "its mask and a 16-bit copy of its dropped input, for one pass fewer of its cast and dropout and no "
              "checkpoint of its own (planned either way); `auto`: `memrecipe run` and `plan` take `false` where the "
              "run fits with it and `true` where only the redraw fits, and the run folder's recipe.yaml says which (a "
              "copied script given `auto` redraws). fp32 runs and compiled layers keep peft's"))
    target_modules: tuple[str, ...] | Literal["all-linear"] = spec(
        ("q_proj", "k_proj", "v_proj", "o_proj"), shown='q/k/v/o_proj',
        help='module names, or `all-linear` (every linear of the decoder layers)')
    modules_to_save: tuple[str, ...] | None = spec(None, shown='null',
        help=('whole modules trained and saved beside the adapters, e.g. `[embed_tokens, lm_head]` when tokens are '
              'added: each is a trained fp32 copy (planned with its gradients and optimizer state)'))
    # DoRA: adds a trained magnitude per output channel (closer to a full fine-tune, slower step)
    use_dora: bool = spec(False, shown='false',
        help=('DoRA: a trained magnitude per output channel (planned); not under ZeRO-3'))
    use_rslora: bool = spec(False, shown='false',
        help='scale by alpha / sqrt(r)')  # instead of alpha / r: steadier at high ranks
    init_lora_weights: bool | Literal["gaussian", "pissa", "olora"] = spec(True, shown='true',
        help=('`true` (B = 0), `false`, `gaussian`, `pissa`, `olora`. PiSSA and OLoRA rewrite the base as it loads: the'
              " run saves the initial adapter (`initial_adapter/`) and converts the final one against it (peft's "
              '`path_initial_model_for_weight_conversion`, rank 2r), so `final/` applies to the ORIGINAL base and '
              '`export --merge` gives the trained model. One process or DDP; not with quantization or DoRA. With a bf16'
              ' base the residual is stored in bf16, and the converted adapter cannot carry that rounding: measured on '
              "the embedded model after 3 steps, its logits differ from the trained model's by up to 0.11 (of 4.4); "
              'with `mixed_precision: no` (an fp32 base) they agree to 1e-4 (tested).'))
    bias: Literal["none", "all", "lora_only"] = spec("none", shown='`none`',
        help=("`none`, `all` (every bias of the model trains), `lora_only` (the targeted layers' biases)"))
    adapter: str | None = spec(None, shown='null',
        help=("a saved LoRA adapter's folder to train on (e.g. an SFT run's `final/`) instead of new adapters: its "
              "weights are the start, and r, alpha, targets, DoRA, rsLoRA, bias and modules_to_save are the adapter's "
              "(the recipe's are replaced; dropout stays the recipe's). `--model runs/<run>/final` sets it and the "
              "model to the adapter's base; `final/` is then the adapter trained on, for that base. Under `run dpo` a "
              "frozen copy of it is the reference (TRL's `ref_adapter_name`)"))


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


if TYPE_CHECKING:
    DpoLoss = str
else:
    DpoLoss = Literal[tuple(PREFERENCE_LOSSES)]  # (the names above)


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
    name: str = spec(shown="the file's stem with `base:`; else required",
                     help="the recipe's name (run folders, reports)")
    description: str = spec("", shown='`""`', keys='`description`, `saves`, `costs`',
        help='one line each for `memrecipe ls`')
    saves: str = spec("", row=False)  # one line for `memrecipe ls`: what memory it saves
    costs: str = spec("", row=False)  # one line for `memrecipe ls`: what it costs
    supports: Supports = spec(Supports(), shown='section',
        help=('the topologies it runs on: `min_processes` (1), `max_processes` (null: any), `multi_node` (true), `cpu` '
              '(true: runs end to end on CPU)'))
    distributed_type: Literal["no", "ddp", "fsdp", "deepspeed"] = spec("no", shown='`no`',
        help='`no` (one process), `ddp`, `fsdp` (needs `fsdp:`), `deepspeed` (needs `deepspeed:`)')
    # model
    model_name_or_path: str | None = spec(None, shown='null',
        help='hub id or local folder; null: the embedded tiny Llama')  # null: the embedded tiny default
    trust_remote_code: bool = spec(False, help="let transformers run the model's own code", shown='false')
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = spec(
        "auto", shown='`auto`',
        help=("`auto` (flash-attn's varlen kernel where installed on CUDA with 16-bit compute; else `flex_attention` "
              "on CUDA for packed rows and rows that reach a sliding window; else `sdpa`; `eager` on CPU for a model "
              "with no sdpa path, Gemma 2: see docs/memory.md), `sdpa`, `eager`, `flash_attention_2`, "
              "`flex_attention` (CUDA only: no backward on CPU); a kernel the model's transformers class has no path "
              "for is refused"))
    # data
    dataset: str | tuple[DataSource, ...] | None = spec(None, shown='null',
        help=('a hub id, a `.jsonl`/`.json`/`.parquet`/`.csv` file or a folder (null: the embedded chat data); or a '
              'list of sources mixed together (below)'))
    dataset_format: DatasetFormat = spec("auto", shown='`auto`',
        help='`text`, `prompt_completion`, `messages`; auto: from the columns')
    eval_dataset: str | tuple[DataSource, ...] | None = spec(None, shown='null',
        help='the same forms as `dataset`; given, it wins over `eval_size`')
    train_on_inputs: bool = spec(False, shown='false',
        help=('false: only completions / assistant turns are targets; true: every token of each document after its '
              'first (prompts and user turns too)'))
    chat_template: str | None = spec(None, shown='null',
        help=("the tokenizer's own; or a Jinja file (or a template given inline) used to render `messages` and saved "
              'with the model. A base model without one is refused before launch, naming this key'))
    eval_size: float | None = spec(0.0, low=0, high=0.5, shown='0',
        help='fraction of `dataset` held out for an eval loss (0 or null: none)')
    max_seq_length: int = spec(512, low=8, shown='512',
        help=("tokens per row; longer examples are truncated (counted in the start-up log); past the model's "
              '`max_position_embeddings`, `plan` and `run` say so and name `rope_scaling`'))
    rope_scaling: RopeScaling | None = spec(None, shown='null',
        help=('RoPE stretched past the positions the model was trained on, written into its config as it loads (the '
              "saved and exported model carry it; the start-up line says it): `rope_scaling.rope_type` `yarn` (TRL's "
              '1M-token example), `linear` or `dynamic`; `rope_scaling.factor` (null: max_seq_length / the original '
              "positions); `rope_scaling.original_max_position_embeddings` (null: the model's "
              '`max_position_embeddings`)'))
    packing: bool = spec(True, shown='true',
        help=('whole documents packed into rows of `max_seq_length`, each with its own positions, none attending across'
              ' another; false: one padded example per row'))
    # batch and schedule
    per_device_train_batch_size: int = spec(4, low=1, help='the micro batch per process', shown='4')
    gradient_accumulation_steps: int = spec(1, low=1, shown='1',
        help="micro batches per optimizer step (exact: the loss is divided by the window's target tokens)")
    num_train_epochs: float = spec(1.0, low=0, low_open=True, help='epochs, unless `max_steps` is set', shown='1')
    max_steps: int | None = spec(None, low=1, shown='null',
        help='optimizer steps; overrides `num_train_epochs`')  # overrides num_train_epochs
    learning_rate: float = spec(2e-4, low=0, low_open=True, high=1.0, shown='2e-4',
        help=('peak learning rate (the shipped recipes: 2e-4 with LoRA, 2e-5 for a full fine-tune; under `run dpo`, '
              '`dpo.learning_rate`)'))
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = spec("cosine", shown='`cosine`',
        help='`cosine`, `linear`, `constant`')
    warmup_steps: int = spec(0, low=0, shown='0 / 0', keys='`warmup_steps` / `warmup_ratio`',
        help='linear warm-up, in steps or as a share of all steps (one of them)')
    warmup_ratio: float = spec(0.0, low=0, high=1, row=False)
    weight_decay: float = spec(0.0, low=0, shown='0',
        help="AdamW's decoupled decay, on weight matrices (embeddings included), never on biases or norms")
    max_grad_norm: float | None = spec(1.0, low=0, low_open=True, shown='1.0',
        help='gradient clipping; null: none')  # null: no clipping
    seed: int = spec(42, low=0, help='model init, data order, mixture draws, dropout', shown='42')
    # memory techniques
    optim: OptimizerName = spec("adamw_torch", shown='`adamw_torch`',
        help=('`adamw_torch`, `adamw_bnb_8bit`, `paged_adamw_8bit` (bitsandbytes), `adamw_torch_8bit` (torchao), '
              '`apollo_adamw`'))  # the table in planning/optimizers.py
    optim_args: OptimArgs = spec(OptimArgs(), shown='section',
        help=('`rank` (128), `proj` (random), `scale_type` (channel), `update_proj_gap` (200), `scale` (1.0), '
              "`proj_type` (std) for APOLLO; `bf16_stochastic_round` (true) for torchao's 8-bit AdamW on bf16 weights"))
    optim_target_modules: tuple[str, ...] | Literal["all-linear"] = spec("all-linear", shown='`all-linear`',
        help='the matrices APOLLO projects: module names, or every linear layer (lm_head included)')
    # each parameter's update runs as soon as its gradient is complete, which is then freed (one
    # parameter's gradient is held, not the model's); no accumulation, clipping or fp16 loss scaling
    optimizer_in_backward: bool = spec(False, shown='false',
        help=('each parameter steps as its gradient completes, and the gradient is freed (one process, no accumulation '
              'or clipping)'))
    # a full fine-tune's trained weights: fp32 (master weights, autocast computes in 16 bits) or bf16 (no
    # master copy: 2 bytes/param, and updates below half a bf16 step need stochastic rounding)
    weight_dtype: Literal["fp32", "bf16"] = spec("fp32", shown='`fp32`',
        help="a full fine-tune's weights: fp32 masters, or bf16 with no master copy")
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = spec("auto", shown='`auto`',
        help='`auto` (bf16 where supported, else fp16), `bf16`, `fp16`, `no`')
    # true: each decoder layer keeps only its input and is recomputed in backward; selective: it keeps its matmuls'
    # and attention's outputs too and recomputes only the cheap ops (more memory, less recompute)
    gradient_checkpointing: bool | Literal["selective"] = spec(False, shown='false',
        help=("`true`: keep each decoder layer's input only, recompute the rest in backward; `selective`: keep its "
              "matmuls' and attention's outputs too and recompute only the cheap ops (more memory, less recompute; "
              'dense models)'))
    activation_offload: bool = spec(False, shown='false',
        help=('the checkpointed inputs wait in host RAM (needs `gradient_checkpointing`)'))
    # each layer's MLP runs a tile of tokens at a time, recomputed in backward: its [tokens x intermediate] tensors
    # exist one tile at a time (true: tiles of about hidden_size tokens; or a number of tiles); the layer's recompute
    # leaves the MLP out under full checkpointing (no extra forward), DeepSpeed's runs it (one more MLP forward)
    tiled_mlp: bool | int = spec(False, low=2, shown='false',
        help=("each decoder layer's MLP runs a tile of tokens at a time, recomputed in backward (`true`: tiles of about"
              ' `hidden_size` tokens; or a number >= 2): its [tokens x intermediate] tensors exist one tile at a time; '
              "one process, or DeepSpeed on any number (told to reduce a weight's gradient after its last tile, every "
              'process running the same count of tiles); not FSDP, DDP on several, `optimizer_in_backward`, '
              '`torch_compile`; dense MLPs only'))
    # each RMSNorm keeps its input instead of an fp32 copy and runs its backward a tile of tokens at a time (fp32
    # buffers over the whole sequence otherwise): gradients equal to rounding, for one more pass over the input
    lean_norms: bool = spec(False, shown='false',
        help=("each RMSNorm (Llama's and the models that copy it) keeps its input as it comes instead of an fp32 copy, "
              'and its backward works a tile of `hidden_size` tokens at a time (`training/norms.py`): the same output '
              'bit for bit, gradients equal to rounding, for one more pass over its input in backward; any engine (not '
              '`torch_compile`, not tensor parallelism)'))
    # sdpa's attention a chunk of queries a call (true: 16,384 queries; or a number): the backward's buffers over a
    # chunk of queries and one of keys, not the sequence, and within the 32-bit offsets of torch's flash kernel past
    # 524,288 tokens; a kernel call per block of a chunk's queries and keys (one more rounding per block's gradient)
    query_chunks: bool | int = spec(False, low=1, shown='false',
        help=("sdpa's attention a chunk of queries at a time (`true`: 16,384; or a number): forward, each chunk "
              'against every key before its end; backward, each chunk of queries against each chunk of keys it sees, '
              'the gradients summed in fp32 (`training/query_chunks.py`). Exact; the backward\'s buffers over a chunk '
              "of queries and one of keys, not the sequence, and past 524,288 tokens within the 32-bit offsets of "
              "torch's flash kernel (CUDA); a kernel call per block. `attn_implementation: sdpa`, rows unpacked, no "
              'ring attention (under Ulysses the chunks run inside its attention)'))
    fused_loss: bool = spec(True, shown='true',
        help=('the LM head and the cross-entropy run chunk by chunk over the target positions, recomputed in backward: '
              'the [tokens x vocab] logits are never held'))
    loss_chunk_tokens: int = spec(LOSS_CHUNK_TOKENS, low=1, shown='512',
        help=('target tokens per chunk of the fused loss: one chunk holds 8 bytes x tokens x vocabulary (0.5 GiB at 512'
              ' x 128k); smaller chunks hold less but re-read the head\'s weights more often (docs/memory.md, "The fused'
              ' loss\'s chunk")'))
    # each decoder layer compiled in place (one graph serves them all): faster steps after a compile on the
    # first step (tens of seconds); batches are padded to a multiple of 64 tokens to bound recompiles
    torch_compile: bool = spec(False, shown='false',
        help=('each decoder layer compiled in place (one graph serves them all; checkpointing wraps it); batches padded'
              ' to a multiple of 64 tokens; the first step compiles (its time is logged). One process or DDP'))
    lora: Lora | None = spec(None, shown='null',
        help='LoRA adapters on a frozen base (below); null: a full fine-tune')  # null: full fine-tune
    quantization: Quantization | None = spec(None, shown='null',
        help=('the frozen base in 4/8 bits as bitsandbytes loads it: `bits` (4), `quant_type` (nf4), `double_quant` '
              "(true), `compute_dtype` (auto), `quant_storage` (bf16), `upcast_unquantized` (false: PEFT's k-bit "
              'preparation off)'))  # null: the base in the compute dtype; needs lora
    fsdp: Fsdp | None = spec(None, shown='null',
        help=('`version` (2), `reshard_after_forward` (true), `activation_checkpointing` (false), `offload_params` '
              '(false), `cpu_ram_efficient_loading` (true), `state_dict_type` (FULL_STATE_DICT), '
              "`transformer_layer_cls_to_wrap` (null: the model's own layer classes), `use_orig_params` (true; FSDP1 "
              'only)'))
    deepspeed: DeepSpeed | None = spec(None, shown='null',
        help=('`zero_stage` (3), `offload_optimizer` / `offload_param` (none, cpu), `pin_memory`, `overlap_comm`, '
              '`contiguous_gradients`, `reduce_bucket_size`, `sub_group_size`, `stage3_prefetch_bucket_size`, '
              '`stage3_param_persistence_threshold`, `stage3_max_live_parameters`, `stage3_max_reuse_distance` '
              "(DeepSpeed's defaults), `zero3_init` (true), `zero3_save_16bit_model` (true)"))
    parallelism: Parallelism | None = spec(None, shown='null',
        help=("through accelerate's ParallelismConfig: `tp_size` (1): tensor parallelism, FSDP2 over the rest (the tp "
              'recipe: 2); `sp_size` (1): Ulysses sequence parallelism on DeepSpeed, each sequence split this many ways'
              ' (null: all the processes; the zero3-ulysses recipe), data parallelism over the rest; `cp_size` (1): '
              "ring attention on FSDP2, CUDA only (torch's context_parallel; `fsdp` or `fsdp-lora` with `packing: "
              'false`, sdpa). One of the three'))  # null: neither tensor nor sequence parallelism
    dpo: Dpo | None = spec(None, shown='null',
        help=("preference tuning's keys, under TRL's names: `beta` (0.1), `loss_type` (`sigmoid`; `ipo`, `hinge`, "
              '`robust`, the reference-free `simpo` and `orpo`, `sft`, or a list of them), `loss_weights` (one per '
              'loss; null: 1 each), `label_smoothing` (0; read by `robust` and `simpo`, refused for the others), '
              '`simpo_gamma` (null: 0.5 under `simpo`; refused for the others), `precompute_ref_log_probs` (null: yes '
              'for a full fine-tune, no under LoRA; false on a full fine-tune: a frozen copy of the model beside it, '
              'sharded under FSDP and ZeRO-3), `max_length` (tokens per sequence, the start kept; null: half of '
              "`max_seq_length`; a pair's two sequences share a row, so 2 x `max_length` above `max_seq_length` is "
              "refused), `learning_rate` (run dpo's peak rate; null: 5e-6 with LoRA, 5e-7 for a full fine-tune, as "
              "alignment-handbook's Zephyr DPO recipes; a `learning_rate=` word under `run dpo` sets it). Read by `run "
              'dpo` (docs/dpo.md), which gives a recipe without the section these defaults; `run sft` refuses it'))
    # logging and saving
    logging_steps: int = spec(1, low=1, help='a log line every N steps (the progress bar shows every step)', shown='1')
    eval_steps: int | None = spec(None, low=1, shown='null',
        help='an eval loss every N steps (and at the end when there is eval data)')
    save_steps: int | None = spec(None, low=1, shown='null',
        help='a checkpoint every N steps (and at the last); null: only the final save')
    save_total_limit: int | None = spec(2, low=1, help='checkpoints kept', shown='2')
    report_to: Literal["none", "tensorboard", "wandb"] = spec("none", shown='`none`',
        help="`none`, `tensorboard`, `wandb` (through accelerate's trackers)")
    # true: when the model is memrecipe's embedded tiny one, its own settings (registry.EMBEDDED_SETTINGS: the
    # learning rates that make random weights learn in seconds, 256-token rows, 3 epochs) replace the recipe's, which
    # are a real model's; key=value overrides still win. A run folder's resolved recipe says false: applied already
    embedded_settings: bool = spec(True, shown='true',
        help=("when the model is memrecipe's embedded tiny Llama (`model_name_or_path: null`), its own settings replace"
              " the recipe's real-model numbers: learning_rate 5e-3 with LoRA, 1e-3 full (also under `run dpo`), "
              '`max_seq_length` 256, `num_train_epochs` 3, what makes random weights learn in seconds; `key=value` '
              "overrides still win, and the start-up line says so. A run folder's resolved recipe says false (applied "
              "already); a recipe `memrecipe config --output-dir` writes keeps the recipe's own numbers and true (false"
              ' where a word set one of those keys); false in your recipe keeps its numbers for the tiny model too'))
    extra: dict = spec({}, shown='`{}`',
        help=('keys of your own for a copied loop script: any YAML, checked by nothing but the script that reads '
              '`recipe.extra["key"]`; set from the command line as `extra.key=VALUE`'))

    @property
    def checkpoints(self) -> bool:
        """Each decoder layer is checkpointed: by the loop (gradient_checkpointing, full or selective) or by FSDP's
        own wrapper (fsdp.activation_checkpointing)."""
        return bool(self.gradient_checkpointing or (self.fsdp and self.fsdp.activation_checkpointing))

    @property
    def recomputes(self) -> bool:
        """Full checkpointing: each decoder layer's forward runs again in backward (the loop's or FSDP's), where
        selective checkpointing recomputes only the cheap ops."""
        return self.checkpoints and self.gradient_checkpointing != "selective"

    @property
    def keeps_dropout(self) -> bool:
        """Whether LoRA's adapters keep peft's dropout (each its mask and dropped input) rather than redrawing it in
        backward: the one rule the loop follows too (training.adapters.add_lora's `redraw`). Kept by compiled layers,
        in fp32 (`mixed_precision: no`: no autocast, so peft's forward runs as it is), and with
        `lora.redraw_dropout: false` (`auto`, left to the loop undecided, redraws: the memory-safe choice; the
        planner decides it by the memory, planner.decide_dropout). Under DeepSpeed's engine the 16-bit adapters redraw
        (a redraw reads the adapter's weight inside the adapter's own backward, where ZeRO-3 has gathered it)."""
        lora = self.lora
        return bool(lora and lora.dropout) and (self.torch_compile
                                                or self.mixed_precision == "no" or lora.redraw_dropout is False)

    @property
    def redraws_dropout(self) -> bool:
        """LoRA's adapters have dropout and redraw it in backward (keeps_dropout's other side): what the plan counts as
        redrawn, and what `lora.redraw_dropout: auto` weighs (planner.decide_dropout)."""
        return bool(self.lora and self.lora.dropout) and not self.keeps_dropout

    @property
    def recompute_skips_tiles(self) -> bool:
        """A layer's recompute leaves its tiled MLP out (training.tiling.TiledMLP, told when a recompute runs by
        training.layers.marked): backward recomputes the MLP tile by tile anyway. Under the loop's full
        checkpointing (under DeepSpeed too, where the recompute stops early at the MLP's save: the MLP ran before
        that save); not where the layers compile (dynamo will not trace the marker inside torch's checkpoint: a
        graph break). For Llama's layers and their copies: a layer whose norm after the MLP saves its output
        (Gemma 2, OLMo 2) still runs it there."""
        return self.tiled_mlp is not False and self.gradient_checkpointing is True and not self.torch_compile

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
