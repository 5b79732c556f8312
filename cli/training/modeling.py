"""Model side of the loop: the Accelerator for this machine, tokenizer and model loading (hub id,
local folder, or the embedded tiny default), LoRA, gradient checkpointing, and prepare (the optimizer
itself is in optimizers.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..errors import RecipeError
from ..planning.registry import EMBEDDED_MODEL, model_cache


def make_accelerator(recipe, **kwargs):
    """The Accelerator for the config accelerate launched us with, made to work on CPU too.

    On a machine without CUDA two accelerate paths need help (measured, see docs/loop.md):
    - DeepSpeed: accelerate finds no backend and would run every rank as a lone process 0;
      a gloo process group fixes the world size and ranks.
    - FSDP: accelerate turns FSDP on only for GPU-like distributed types; the process state is
      set up for CPU (gloo) and marked MULTI_GPU so the FSDP plugin takes over, with device `cpu`.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin,
                                  InitProcessGroupKwargs)

    if os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no":
        raise RecipeError("the launch config asks accelerate to compile the whole model (dynamo_config), which wraps "
                          "it and renames its weights: remove dynamo_config and set torch_compile: true in the recipe")
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = list(kwargs.pop("kwargs_handlers", []))
    if not torch.cuda.is_available() and launched:
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true":
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        elif os.environ.get("ACCELERATE_USE_FSDP", "false") == "true":
            state = PartialState(cpu=True)
            state.distributed_type = DistributedType.MULTI_GPU
    # Windows of micro batches are built by the loop, so accelerate must not sync on its own at the
    # end of the dataloader (that would cut the window short).
    plugin = GradientAccumulationPlugin(num_steps=recipe.gradient_accumulation_steps, sync_with_dataloader=False)
    # A seeded sampler: every epoch's shuffle is a function of the recipe's seed and the epoch alone, the same on
    # every process, topology and resume (accelerate's SeedableRandomSampler seeds each epoch with data_seed + epoch).
    data = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.seed)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin, dataloader_config=data, kwargs_handlers=handlers,
                              **kwargs)
    if accelerator.mixed_precision == "fp16" and recipe.fp16_blocker:  # the launch config's precision wins
        raise RecipeError(f"the launch config runs mixed_precision fp16, and {recipe.fp16_blocker}: set "
                          "mixed_precision: bf16 in it (or regenerate it with memrecipe config on a GPU with bf16)")
    return accelerator


def embedded_model(timeout: float = 600.0) -> str:
    """The embedded tiny Llama, saved like a hub model in a cache folder, so that it loads through
    the real from_pretrained path and a LoRA adapter has a base to point at.

    Built before any process group exists (under ZeRO-3 a lone rank building a model would wait
    for the others forever): each machine's local rank 0 builds it from the shipped config with a
    fixed seed and renames it into place; the other ranks wait for it to appear.
    """
    import hashlib
    import time

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256(torch.__version__.encode())
    for name in ("config.json", "tokenizer.json"):
        digest.update((EMBEDDED_MODEL / name).read_bytes())
    cache = model_cache()
    folder = cache / f"tiny-llama-{digest.hexdigest()[:12]}"
    if not folder.is_dir() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        staging = cache / f".{folder.name}.{os.getpid()}"
        config = AutoConfig.from_pretrained(EMBEDDED_MODEL)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(EMBEDDED_MODEL).save_pretrained(staging)
        try:
            staging.rename(folder)  # atomic: readers see no folder or a complete one
        except OSError:  # another machine's rank built it first: the same weights
            shutil.rmtree(staging, ignore_errors=True)
    deadline = time.monotonic() + timeout
    while not folder.is_dir():
        if time.monotonic() > deadline:
            raise RecipeError(f"the embedded model did not appear in {folder} within {timeout:.0f} s")
        time.sleep(0.2)
    return str(folder)


def check_model(name_or_path: str, trust_remote_code: bool = False):
    """The model's config, or a one-line error: missing path, offline, gated, remote code, not a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if name_or_path.startswith((".", "/", "~")) and not Path(name_or_path).expanduser().exists():
        raise RecipeError(f"model path {name_or_path} does not exist")
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers and the hub raise many kinds; name the likely cause
        text = " ".join(str(e).split())
        low = text.lower()
        if "trust_remote_code" in low:
            raise RecipeError(f"model {name_or_path} runs its own code from the hub: set trust_remote_code=true "
                              "if you trust it") from None
        if "gated" in low or "401" in low or "403" in low:
            raise RecipeError(f"model {name_or_path} is gated: accept its licence on the hub and set HF_TOKEN") from None
        if "offline" in low or "connect" in low or "not a valid model identifier" in low or "not found" in low:
            raise RecipeError(f"model {name_or_path} is neither a local folder nor reachable on the hub "
                              "(offline, or a typo?)") from None
        raise RecipeError(f"cannot read the config of model {name_or_path}: {text[:300]}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise RecipeError(f"model {name_or_path} ({config.model_type}) is not a causal language model")
    return config


def check_tokenizer(name_or_path: str, trust_remote_code: bool = False, chat_template: str | None = None,
                    chat: bool = False):
    """A loadable tokenizer beside the model (with a chat template if `chat` data needs one), or a one-line
    error (before anything is launched). Returns it."""
    from .data import NO_TEMPLATE

    try:
        tokenizer = load_tokenizer(name_or_path, trust_remote_code, chat_template)
    except RecipeError:
        raise
    except Exception as e:  # sentencepiece, tiktoken, missing files: each library raises its own kind
        text = " ".join(str(e).split())[:200]
        raise RecipeError(f"model {name_or_path} has no tokenizer memrecipe can load (save it beside the model with "
                          f"tokenizer.save_pretrained, e.g. tokenizer.json): {text}") from None
    if chat and not tokenizer.chat_template:
        raise RecipeError(f"model {name_or_path}: {NO_TEMPLATE}")
    return tokenizer


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (a Jinja file, or the template itself) replaces its own,
    and is saved with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:  # padding is masked out of the loss, any token will do
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """The recipe's chat_template: a Jinja template given inline, or the text of a file; compiled here, as
    transformers compiles it (its sandbox and extensions), so that a broken one is refused before launch."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    inline = "{%" in value or "{{" in value
    path = Path(value).expanduser()
    if not inline and not path.is_file():
        raise RecipeError(f"chat_template {value} is neither a file nor a Jinja template ({{% ... %}})")
    text = value if inline else path.read_text(encoding="utf-8")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        where = "the inline chat_template" if inline else f"chat_template {value}"
        raise RecipeError(f"{where} is not valid Jinja (line {e.lineno}: {e.message})") from None
    return text


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "no": torch.float32,
          "uint8": torch.uint8}


def quantization_config(recipe, precision: str):
    """transformers' BitsAndBytesConfig from the recipe's quantization section."""
    from transformers import BitsAndBytesConfig

    q = recipe.quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = TORCH_DTYPES[precision if q.compute_dtype == "auto" else q.compute_dtype]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant, bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_storage=TORCH_DTYPES[q.quant_storage])


class CopyStreams:
    """Where HostOffload's copies run on CUDA: a side stream, ordered against the compute stream by events, so that
    a copy overlaps the layers around it instead of queueing between them (torchtune's OffloadActivations is the
    reference design). Tests stand in a recorder with the same methods (no side stream exists on CPU)."""

    def __init__(self, device):
        self.side, self.device = torch.cuda.Stream(device), device

    def side_waits_compute(self):  # the tensor to copy is written
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def on_side(self):
        return torch.cuda.stream(self.side)

    def record(self):
        return self.side.record_event()

    def compute_waits(self, event):
        torch.cuda.current_stream(self.device).wait_event(event)

    def used_by_compute(self, tensor):  # made on the side stream, freed after the compute stream's use
        tensor.record_stream(torch.cuda.current_stream(self.device))

    @staticmethod
    def done(event) -> bool:
        return event.query()


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Tensors saved for backward inside this context wait in pinned host memory and come back to their device in
    backward. On CUDA both copies run on a side stream (CopyStreams): forward's device-to-host copy keeps the device
    tensor alive until its event says it is done; backward's host-to-device copy of the tensor needed next (the
    previous layer's, in backward order) is issued as soon as the current one is unpacked, so it overlaps this
    layer's recompute, and the compute stream waits on its event only when it needs it. On CPU (smoke-test mode)
    the tensor stays where it is, host memory already; `copy_on_cpu` parks a copy, for tests. Counts what it holds."""

    def __init__(self, copy_on_cpu: bool = False, streams=None):
        self.tensors = self.bytes = self.copied = 0
        self.copy_on_cpu, self.streams = copy_on_cpu, streams
        self.key = 0
        self.host, self.alive, self.back = {}, {}, {}  # key -> host copy; -> (device tensor, event); -> fetched
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor):
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        streams = self.streams or (CopyStreams(tensor.device) if tensor.device.type == "cuda" else None)
        if streams is None:
            if not self.copy_on_cpu:
                return tensor.device, tensor
            self.copied += 1
            return tensor.device, tensor.detach().clone()  # a separate host tensor, as on CUDA
        self.streams = streams
        self._release_copied()
        streams.side_waits_compute()
        with streams.on_side():
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                               pin_memory=tensor.device.type == "cuda")
            host.copy_(tensor, non_blocking=True)
            event = streams.record()
        self.copied += 1
        self.key += 1
        self.host[self.key], self.alive[self.key] = (tensor.device, host), (tensor, event)
        return None, self.key

    def _unpack(self, packed):
        device, tensor = packed
        if device is not None:  # not on a side stream: the tensor itself, or its host copy
            return tensor.to(device)
        key = tensor
        fetched, event = self.back.pop(key, None) or self._fetch(key)
        self.streams.compute_waits(event)
        self.streams.used_by_compute(fetched)
        if key - 1 in self.host:  # prefetch: the next tensor backward unpacks (the previous layer's input)
            self.back[key - 1] = self._fetch(key - 1)
        return fetched

    def _fetch(self, key):
        self._release_copied()
        device, host = self.host.pop(key)
        with self.streams.on_side():
            fetched = host.to(device, non_blocking=True)
            return fetched, self.streams.record()

    def _release_copied(self):
        """Drop the device tensors whose copy to the host has finished."""
        for key in [k for k, (_, event) in self.alive.items() if self.streams.done(event)]:
            del self.alive[key]


def enable_checkpointing(model, offload: bool) -> HostOffload | None:
    """The model's own (non-reentrant) gradient checkpointing; with offload, each checkpointed
    layer's saved input goes to host memory. transformers' own offload=True always pins memory,
    which fails on a machine without CUDA (measured), so the offload wraps its checkpoint function."""
    import functools

    # non-reentrant: works with frozen inputs (LoRA) and with FSDP/DeepSpeed
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not offload:
        return None
    hooks = HostOffload()

    def offloaded(checkpoint, *args, **kwargs):
        with hooks:  # the checkpoint saves its inputs under our hooks; the recompute's tensors stay on the device
            return checkpoint(*args, **kwargs)

    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = functools.partial(offloaded, module._gradient_checkpointing_func)
    return hooks


def tensor_parallel(model, tp_size: int, device_mesh) -> None:
    """Split the model's linears over the mesh's "tp" dimension with its own TP plan (colwise/rowwise per
    linear); FSDP2 then shards over the mesh's other dimensions. transformers' from_pretrained(distributed_config)
    would build a mesh of its own that must span every process (transformers/distributed/utils.py,
    initialize_distributed_mesh), so a tp 2 x dp 2 run on 4 ranks fails there: the plan is applied here
    on accelerate's mesh instead. Every rank holds the loaded weights and keeps its own slice of each
    (distribute_tensor with src_data_rank=None: no communication)."""
    from transformers import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = DistributedConfig(tp_plan="auto", tp_size=tp_size)
    plan, _, _ = model._resolve_parallel_plans(config)
    tp_mesh = device_mesh["tp"] if device_mesh.mesh_dim_names != ("tp",) else device_mesh
    apply_tensor_parallelism(model, tp_mesh, plan)
    model.config.distributed_config = config  # where accelerate reads the TP size (utils/other.py, get_model_tp_size)


def attention(recipe, name_or_path: str, precision: str, device=None):
    """The attention kernel this process runs (planning.attention.pick_attention), from the facts here: transformers' own
    flash-attn check (package, version, CUDA), Triton for flex_attention's CUDA kernel, and the model: its class
    must support the kernel (transformers refuses otherwise) and flex refuses attention dropout in training."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_flash_attn_2_available

    from ..planning.attention import pick_attention

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=recipe.trust_remote_code)
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError):  # remote code: its class is known once loaded; assume it supports both
        model_class = None
    cuda = device is not None and device.type == "cuda"
    flash = is_flash_attn_2_available() and getattr(model_class, "_supports_flash_attn", True)
    flex = (cuda and importlib.util.find_spec("triton") is not None and getattr(model_class, "_supports_flex_attn", True)
            and not getattr(config, "attention_dropout", 0))
    return pick_attention(recipe.attn_implementation, cuda=cuda, half=precision in ("bf16", "fp16"), packing=recipe.packing,
                   flash=flash, flex=flex)


def load_pretrained(recipe, name_or_path: str, precision: str, device=None, own_weights: bool = False):
    """from_pretrained in the recipe's weight dtype, and with its quantization (bitsandbytes 4- or 8-bit, quantized
    as it loads): what the base holds. No KV cache (it is for generation). Under FSDP2's cpu_ram_efficient_loading
    the processes but rank 0 build it without weights (rank0_loads), unless `own_weights` (a copy that accelerate
    does not prepare, so that nothing broadcasts into it)."""
    from transformers import AutoModelForCausalLM

    # A frozen LoRA base is stored in the compute dtype (2 bytes/param); trained weights stay fp32
    # masters and mixed precision casts them for compute, unless the recipe trains them in bf16.
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    dtype = half if recipe.lora and half is not None else TORCH_DTYPES[recipe.weight_dtype]
    extra = {}
    q = recipe.quantization
    if q is not None:
        extra["quantization_config"] = quantization_config(recipe, precision)
        if q.quant_storage != "uint8":  # FSDP shards one dtype: the unquantized weights match the 4-bit storage
            dtype = TORCH_DTYPES[q.quant_storage]
        if recipe.fsdp is not None:
            # Under FSDP every rank loads the whole 4-bit model (transformers 5.23 has no "CPU or meta under
            # FSDP" branch any more), and with no device_map the bitsandbytes quantizer would put it on this
            # rank's GPU (quantizers/quantizer_bnb_4bit.py, update_device_map): a 70B at ~39 GB per GPU.
            # Quantized on the host instead, FSDP moves each rank's shards to its GPU, and Params4bit.to moves
            # every weight's quant_state along (bitsandbytes/nn/modules.py, Params4bit.to; FSDP1 moves with
            # `param.data = param.to(device_id)`, torch/distributed/fsdp/_init_utils.py, _move_states_to_device).
            extra["device_map"] = {"": "cpu"}
        elif device is not None and device.type == "cuda":
            extra["device_map"] = {"": device}  # quantize straight onto this process's GPU
    kernel = attention(recipe, name_or_path, precision, device)  # attn_implementation: auto, resolved here
    if q is None and not own_weights and rank0_loads(recipe):
        model = without_weights(name_or_path, dtype, kernel.name, recipe.trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation=kernel.name,
                                                     trust_remote_code=recipe.trust_remote_code, **extra)
    model.memrecipe_attention = kernel  # why this kernel, for the start-up log and the report (measure.describe_setup)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if q is not None and q.upcast_unquantized:
        from peft import prepare_model_for_kbit_training

        # PEFT's QLoRA preparation: unquantized weights (norms, embeddings, head) to fp32, and with them
        # the residual stream. Off by default: they stay in 16 bits (LoRA then trains the same way as
        # on a bf16 base; non-reentrant checkpointing needs no input gradients, which PEFT also sets up).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if q is not None and (device is None or device.type == "cpu"):
        # On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks 4-bit weights for inference in place at
        # the first no-grad eval forward: it fails when in_features is not a multiple of 64, and
        # training would go on with inference-packed weights. Keep the training layout.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    return model


def rank0_loads(recipe) -> bool:
    """This process builds the model without its weights, which FSDP2 then receives from rank 0 as shards: the launch
    config's cpu_ram_efficient_loading (the FSDP plugin has set FSDP_CPU_RAM_EFFICIENT_LOADING by now), on a process
    other than the global rank 0, whose full state dict accelerate broadcasts (fsdp2_load_full_state_dict, src 0).
    transformers 5 loads every rank's weights itself, so without this each process holds the whole model once."""
    from accelerate.utils import str_to_bool

    return (recipe.fsdp is not None and recipe.fsdp.version == 2 and int(os.environ.get("RANK", "0")) != 0
            and str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false")) == 1
            and str_to_bool(os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")) == 1)


def without_weights(name_or_path: str, dtype, attn_implementation: str, trust_remote_code: bool):
    """The model built from its config with storage for its parameters that nothing writes (untouched pages hold no
    host RAM), its buffers computed as usual (the rotary frequencies: FSDP2 does not broadcast non-persistent
    buffers). Tied weights stay tied."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    made = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return model


def compile_layers(model) -> int:
    """Compile each decoder layer in place (nn.Module.compile), as torchtune does and accelerate's regional
    compilation: the layers share one graph (dynamo treats their weights as inputs), checkpointing wraps
    the compiled layer, and the model keeps its modules, hooks and state-dict names. The head, the fused
    loss and the mask building stay eager. Returns the number of layers compiled."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RecipeError(f"torch_compile: {type(model).__name__} names no decoder-layer class (_no_split_modules)")
    for layer in layers:
        layer.compile()
    return len(layers)


def lora_config(lora):
    """peft's LoraConfig for the recipe's lora: section (the same names)."""
    from peft import LoraConfig

    listed = lambda names: names if isinstance(names, str) or names is None else list(names)  # noqa: E731
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=listed(lora.target_modules), modules_to_save=listed(lora.modules_to_save),
                      use_dora=lora.use_dora, use_rslora=lora.use_rslora, init_lora_weights=lora.init_lora_weights,
                      bias=lora.bias, task_type="CAUSAL_LM")


REFERENCE_ADAPTER = "reference"  # a saved adapter's frozen copy beside the one that trains (DPO's reference model)


def add_lora(model, lora, reference: bool = False):
    """The model with peft's adapters: new ones, or a saved adapter's weights to train on (`lora.adapter`) and, with
    `reference`, a frozen copy of them beside it (named REFERENCE_ADAPTER: under DPO the reference is the model
    the adapter makes, as TRL's ref_adapter_name; a few MB, no second model). Everything that trains is fp32, as
    the adapters are: peft upcasts its adapter layers, not the copies of modules_to_save nor the biases that
    `bias` trains, which would otherwise take AdamW's updates in the base's 16 bits."""
    from peft import PeftModel, get_peft_model

    if lora.adapter:
        model = PeftModel.from_pretrained(model, lora.adapter, is_trainable=True, config=lora_config(lora))
        if reference:
            model.load_adapter(lora.adapter, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    else:
        model = get_peft_model(model, lora_config(lora))
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
    return model


def rewrites_base(recipe) -> bool:
    """LoRA inits that change the base weights (pissa, olora): the saved adapter is converted back."""
    return recipe.lora is not None and recipe.lora.init_lora_weights in ("pissa", "olora")


def save_initial_adapter(model, folder: Path) -> None:
    """The adapter as initialized, before training: what peft subtracts to convert a PiSSA/OLoRA adapter
    into one that applies to the original base. Saved with init_lora_weights true, as peft asks, so
    that loading it does not decompose the base again."""
    config = model.peft_config["default"]
    init, config.init_lora_weights = config.init_lora_weights, True
    try:
        model.save_pretrained(folder)
    finally:
        config.init_lora_weights = init


def keep_initial_adapter(model, recipe, folder: Path, main_process: bool = True) -> Path | None:
    """PiSSA/OLoRA (`rewrites_base`): the adapter as initialized, saved once (by the main process) into `folder`
    before training, to convert the final adapter back to one for the original base (save_final). None for
    every other LoRA init and for full fine-tunes: nothing to convert."""
    if not rewrites_base(recipe):
        return None
    if main_process and not folder.exists():
        save_initial_adapter(model, folder)
    return folder


def _fsdp1(accelerator, recipe) -> bool:
    return accelerator.distributed_type.value == "FSDP" and recipe.fsdp is not None and recipe.fsdp.version == 1


def wrap_first(accelerator, recipe, model):
    """FSDP1 flattens parameters, so its optimizer must be built on the wrapped model: the model is
    wrapped here (with LoRA and flat parameters the adapters get FSDP units of their own, PEFT's wrap
    policy; a 4-bit base computes in its storage dtype), as transformers' Trainer does. Every other
    engine takes the model and the optimizer together in `prepare`: the model is returned as it is."""
    if not _fsdp1(accelerator, recipe):
        return model
    fsdp, plugin = recipe.fsdp, accelerator.state.fsdp_plugin
    if recipe.lora and not fsdp.use_orig_params:
        from peft.utils.other import fsdp_auto_wrap_policy

        plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model)
    storage = recipe.quantization.quant_storage if recipe.quantization else None
    if storage not in (None, "uint8"):
        plugin.set_mixed_precision(TORCH_DTYPES[storage], override=True)
    return accelerator.prepare(model)


def prepare(accelerator, recipe, model, optimizer, *loaders):
    """accelerate's prepare of the model (unless `wrap_first` wrapped it), the optimizer and the data
    loaders (a None loader stays None): (model, optimizer, *loaders)."""
    given = [loader for loader in loaders if loader is not None]
    objects = ([] if _fsdp1(accelerator, recipe) else [model]) + [optimizer, *given]
    prepared = accelerator.prepare(*objects)
    prepared = list(prepared) if len(objects) > 1 else [prepared]
    if len(prepared) == len(given) + 1:  # FSDP1: the model was prepared already
        prepared.insert(0, model)
    rest = iter(prepared[2:])
    return (prepared[0], prepared[1], *(next(rest) if loader is not None else None for loader in loaders))


def frozen_copy(recipe, name_or_path: str, accelerator):
    """A second, frozen copy of the initial model beside the policy: DPO's reference for a full fine-tune with
    `dpo.precompute_ref_log_probs: false`. Loaded as the policy is (dtype, quantization), its head fused, no
    gradients, in eval mode. Under FSDP2 it is sharded like the policy (each decoder layer, then the root, with the
    launch config's mixed precision: its forward gathers one layer at a time), partitioned under ZeRO-3 (a DeepSpeed
    engine of its own, without an optimizer); else each process holds it whole (DDP and ZeRO-1/2, as TRL does)."""
    from .loss import fuse_head

    model = load_pretrained(recipe, name_or_path, accelerator.mixed_precision, accelerator.device, own_weights=True)
    model.requires_grad_(False).eval()
    if recipe.fused_loss:
        fuse_head(model, recipe.loss_chunk_tokens)
    if accelerator.distributed_type.value == "FSDP" or recipe.fsdp is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        plugin = accelerator.state.fsdp_plugin
        mesh = getattr(accelerator, "torch_device_mesh", None)
        options = {"mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(), "reshard_after_forward": True,
                   "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None}
        if plugin.cpu_offload:  # fsdp.offload_params: the copy's shards wait in host memory too
            options["offload_policy"] = plugin.cpu_offload
        # not accelerate's fsdp2_prepare_model, the policy's: it leaves the root and the head gathered after a
        # forward (backward follows); a forward-only copy reshards everything (tested: held = its shard)
        layers = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module, **options)
        fully_shard(model, **options)
        return model
    if accelerator.distributed_type.value == "DEEPSPEED" and recipe.deepspeed.zero_stage == 3:
        import copy

        import deepspeed

        # loaded partitioned (zero.Init, as the policy was); an engine of its own gathers each layer in its forward.
        # No optimizer: the run's optimizer, scheduler and optimizer offload are left out of its config (as TRL does)
        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # (DeepSpeed's eval returns None)
        return engine
    return model.to(accelerator.device)
