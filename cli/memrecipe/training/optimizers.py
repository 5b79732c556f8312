"""The optimizer a recipe names, built on the model: AdamW from torch, bitsandbytes (8-bit, paged on
CUDA), torchao (8-bit, stochastic rounding into bf16 weights), APOLLO (low-rank state), or DeepSpeed's
CPU Adam; its parameter groups (weight decay for matrices, 32-bit state for embeddings, projected
matrices); and, with optimizer_in_backward, one optimizer per parameter stepped during backward."""

from __future__ import annotations

import functools
import time

import torch

from ..planning.optimizers import OPTIMIZERS

EMBEDDING_BITS = 32  # 8-bit optimizers keep embeddings' state in 32 bits (as transformers' Trainer does):
# a row's moments see a gradient only when its token occurs, and blockwise 8-bit scales lose the rare rows


def is_matrix(p) -> bool:
    """A weight matrix (decayed), not a norm or a bias, by the shape the parameter has in the model. FSDP1's flat
    parameters are 1-D: their original tensors' shapes decide (all matrices, as PEFT's wrap policy gives the
    adapters units of their own). ZeRO-3 built partitioned (zero.Init) leaves every parameter an empty 1-D tensor
    and keeps its shape in `ds_shape` (deepspeed/runtime/zero/partition_parameters.py): read there, or no weight
    would decay."""
    shapes = getattr(p, "_shapes", None)  # torch's FlatParameter: the shapes of the tensors it flattens
    if shapes:
        return all(len(shape) >= 2 for shape in shapes)
    return len(getattr(p, "ds_shape", p.shape)) >= 2


def projected_names(model, targets) -> set[str]:
    """The weights a low-rank optimizer projects: nn.Linear weights named by `targets` (module names, or
    all-linear: every one, lm_head included), as transformers' Trainer picks them. A head tied to the
    embeddings is not projected (it is the embedding's weight, and named so)."""
    picked = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (targets == "all-linear" or name.rsplit(".", 1)[-1] in targets):
            picked.add(f"{name}.weight" if name else "weight")
    return picked


def param_groups(recipe, model) -> list[dict]:
    """Trainable parameters in groups: decayed matrices, undecayed norms and biases; for 8-bit optimizers
    the embeddings apart with 32-bit state; for low-rank optimizers the projected matrices apart
    with the projection's options (optim_args)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    projected = projected_names(model, recipe.optim_target_modules) if recipe.low_rank else set()
    if recipe.low_rank and not projected:
        from ..errors import RecipeError

        raise RecipeError(f"optim_target_modules {recipe.optim_target_modules!r} names no linear layer of this "
                          "model (module names such as q_proj, or all-linear)")
    a = recipe.optim_args
    options = {"projected": {"rank": a.rank, "proj": a.proj, "scale_type": a.scale_type,
                             "update_proj_gap": a.update_proj_gap, "scale": a.scale, "proj_type": a.proj_type},
               "embedding": {"optim_bits": EMBEDDING_BITS}}
    groups: dict[str, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in projected:
            kind = "projected"
        elif id(p) in embeddings and OPTIMIZERS[recipe.optim].eight_bit:
            kind = "embedding"
        else:
            kind = "decay" if is_matrix(p) else "no_decay"
        decay = recipe.weight_decay if is_matrix(p) else 0.0
        groups.setdefault(kind, {"params": [], "weight_decay": decay, **options.get(kind, {})})["params"].append(p)
    return list(groups.values())


def make_optimizer(recipe, model, accelerator):
    """The recipe's optimizer over the model's trainable parameters; with optimizer_in_backward, one per
    parameter behind a StepInBackward; torchao's step compiled before step 1 (compile_ahead). DeepSpeed's
    optimizer offload runs DeepSpeed's CPU Adam (it refuses a client optimizer on offloaded state)."""
    groups = param_groups(recipe, model)
    ds = recipe.deepspeed
    if ds is not None and ds.offload_optimizer != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=recipe.learning_rate, adamw_mode=True)
    build = optimizer_factory(recipe, accelerator.device)
    optimizer = StepInBackward(groups, build) if recipe.optimizer_in_backward else build(groups)
    # torchao's compiled step: compiled here, before step 1, its seconds kept for the report
    optimizer.compile_seconds = compile_ahead(optimizer)  # pyright: ignore[reportAttributeAccessIssue]  (ours, read by facts)
    return optimizer


def optimizer_factory(recipe, device):
    """groups -> the recipe's optimizer (a function: optimizer_in_backward builds one per parameter), from the
    builder its entry in the table names (memrecipe.planning.optimizers)."""
    return globals()[OPTIMIZERS[recipe.optim].builder](recipe, device)


def torch_adamw(recipe, device):
    return lambda groups: torch.optim.AdamW(groups, lr=recipe.learning_rate)


def bnb_8bit(recipe, device):
    cls = bnb_adamw8bit(paged=recipe.optim == "paged_adamw_8bit" and device.type == "cuda")  # paging needs CUDA
    return lambda groups: cls(groups, lr=recipe.learning_rate)


def torchao_8bit(recipe, device):
    cls, rounding = torchao_adamw8bit(), recipe.optim_args.bf16_stochastic_round
    return lambda groups: cls(groups, lr=recipe.learning_rate, bf16_stochastic_round=rounding,
                              compiled=device.type == "cuda")


def apollo(recipe, device):
    cls = apollo_adamw()
    return lambda groups: cls(groups, lr=recipe.learning_rate)


@functools.cache
def apollo_adamw():
    """apollo-torch's APOLLOAdamW, whose loaded state lands on its parameters' devices. Its state holds projector
    objects (GradientProjector, GaLoreProjector); torch's load_state_dict moves the tensors, dicts and lists of a
    state to the parameter's device (optimizer.py, _process_value_according_to_param_policy) but returns any other
    object as it is, so a projection matrix stays where the checkpoint was loaded (accelerate loads to the CPU
    with one process), and random_projector.py multiplies the GPU's gradient by it."""
    from apollo_torch import APOLLOAdamW
    from apollo_torch.random_projector import GradientProjector
    from apollo_torch.svd_projector import GaLoreProjector

    # the projectors live in the optimizer state: let checkpoints load them with weights_only
    torch.serialization.add_safe_globals([GradientProjector, GaLoreProjector])

    class APOLLO(APOLLOAdamW):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            for p, state in self.state.items():
                for key, value in state.items():
                    state[key] = on_device(value, p.device)

    APOLLO.__name__ = APOLLOAdamW.__name__
    return APOLLO


def on_device(value, device: torch.device):
    """`value` with every tensor it reaches on `device`: in dicts, lists, tuples and objects' attributes (moved
    in place), dtypes unchanged."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        for name, attribute in vars(value).items():
            setattr(value, name, on_device(attribute, device))
    return value


@functools.cache
def bnb_adamw8bit(paged: bool):
    """bitsandbytes' (Paged)AdamW8bit, with 32-bit state for groups marked `optim_bits: 32`. (Trainer marks
    embeddings through bitsandbytes' process-wide GlobalOptimManager, keyed by id(param); a group's own
    key cannot outlive its model.)"""
    import bitsandbytes as bnb

    base = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit

    class AdamW8bit(base):  # pyright: ignore[reportGeneralTypeIssues]  (one of two bitsandbytes classes)
        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            if "optim_bits" in group:
                config["optim_bits"] = group["optim_bits"]
            return config

        def load_state_dict(self, state_dict, move_to_device=True):
            """A paged optimizer keeps each parameter's large state in CUDA managed memory (get_state_buffer:
            functional.get_paged for >= 1e5 elements), which the driver may move to the host under pressure, but a
            loaded state is ordinary tensors that its first step moves into the allocator (to_gpu): the second GPU
            lease's resumed adamw-8bit run held none paged. Copied back into paged buffers, as get_state_buffer
            makes them. (Paged only on CUDA: bnb_8bit.)"""
            super().load_state_dict(state_dict, move_to_device)
            if not self.is_paged:
                return
            from bitsandbytes import functional as F

            for p, state in self.state.items():
                for key, value in state.items():
                    if (torch.is_tensor(value) and value.shape == p.shape and p.numel() >= 1e5
                            and not getattr(value, "is_paged", False)):
                        paged = F.get_paged(*value.shape, dtype=value.dtype, device=p.device)
                        paged.copy_(value)  # (a host view of the managed memory)
                        self.page_mng.paged_tensors.append(paged)
                        state[key] = paged

    AdamW8bit.__name__ = base.__name__
    return AdamW8bit


@functools.cache
def torchao_adamw8bit():
    """torchao's AdamW8bit, with fp32 moments for groups marked `optim_bits: 32`, built on first use
    (torchao takes ~1.5 s to import). Off CUDA its step runs eagerly: torchao compiles it per parameter
    shape, which costs ~50 s on 2 CPU cores the first time for a tiny model and buys a smoke test
    nothing (the same arithmetic runs, unfused)."""
    from torchao.optim import AdamW8bit

    class TorchaoAdamW8bit(AdamW8bit):
        def __init__(self, params, *, compiled: bool, **kwargs):
            super().__init__(params, **kwargs)
            self.compiled = compiled
            self.full_precision = {id(p) for g in self.param_groups if g.get("optim_bits") == 32 for p in g["params"]}

        def _new_buffer(self, p, signed):
            if id(p) in self.full_precision:
                return torch.zeros_like(p, dtype=torch.float32)
            return super()._new_buffer(p, signed)

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            # torch casts loaded state to its parameter's dtype: put the 32-bit moments back as saved
            params = [p for g in self.param_groups for p in g["params"]]
            for index, saved in state_dict["state"].items():
                p = params[index]
                if id(p) in self.full_precision:
                    self.state[p].update({k: v.to(p.device) for k, v in saved.items() if k != "step"})

        def step(self, closure=None):
            if self.compiled:
                return super().step(closure)
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

        def kind(self, p, group) -> tuple:
            """What torchao's compiled step is specialized on (compile(dynamic=False) guards shapes, strides, dtypes,
            devices, and its float arguments as constants): one graph per distinct kind."""
            options = tuple(sorted((k, v) for k, v in group.items() if k not in ("params", "lr", "initial_lr")))
            return tuple(p.shape), p.stride(), p.dtype, p.device, id(p) in self.full_precision, options

        def compile_for(self, p, group):
            """Compile the graph p's first step will run: one step of a throwaway twin (the same group options)
            on a zero parameter and gradient of p's kind. The run's parameters and state are not touched."""
            scratch = torch.nn.Parameter(torch.zeros_like(p))
            scratch.grad = torch.zeros_like(p)
            twin = type(self)([{**group, "params": [scratch]}], compiled=True, block_size=self.block_size,
                              bf16_stochastic_round=self.bf16_stochastic_round)
            twin.step()

    return TorchaoAdamW8bit


def compile_ahead(optimizer) -> float:
    """Compile torchao's step for every kind of parameter it will step, now rather than inside step 1: under
    optimizer_in_backward it would compile in the middle of the first backward (torchao measured ~12 minutes on a 7B),
    and step 1's time would be the compile's. Each kind is compiled once (the 8B's ~290 parameters are ~7 kinds);
    torch.compile caches the graphs on torchao's function, which every later step finds. The RNG is left as it was
    (stochastic rounding draws from it). Returns the seconds it took: 0.0 when nothing compiles (another optimizer,
    or torchao's step run eagerly off CUDA)."""
    parts = list(optimizer.optimizers.values()) if isinstance(optimizer, StepInBackward) else [optimizer]
    kinds = {}
    for part in parts:
        if getattr(part, "compiled", False):
            for group in part.param_groups:
                for p in group["params"]:
                    kinds.setdefault(part.kind(p, group), (part, group, p))
    if not kinds:
        return 0.0
    from tqdm.auto import tqdm

    start = time.perf_counter()
    main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # (one bar, not one a process)
    devices = sorted({p.device.index or 0 for _, _, p in kinds.values() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        for part, group, p in tqdm(list(kinds.values()), desc="compiling torchao's 8-bit AdamW step", unit="kind",
                                   disable=not main):
            part.compile_for(p, group)
    return time.perf_counter() - start


class StepInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, stepped by the parameter's post-accumulate-grad hook as soon as its
    gradient is complete, which is then freed: one parameter's gradient is held at a time, not the model's
    (torchtune's optimizer_in_bwd, transformers' *_layerwise optimizers). To the loop, the LR scheduler and
    accelerate it is one optimizer: step() and zero_grad() have nothing left to do, `param_groups` are the
    per-parameter optimizers' own groups (the scheduler sets their learning rates), and the state dict
    holds every optimizer's. `gradient_peak` is the most gradient bytes alive at once in the first backward,
    measured in the hooks."""

    def __init__(self, groups: list[dict], build):
        params = [p for g in groups for p in g["params"]]
        super().__init__(params, {})
        self.optimizers = {}
        for index, (group, p) in enumerate(((g, p) for g in groups for p in g["params"]), start=1):
            optimizer = build([{**group, "params": [p]}])
            if "seed" in optimizer.state[p]:  # APOLLO seeds each projection by the parameter's position
                optimizer.state[p]["seed"] = index
            self.optimizers[p] = optimizer
            p.register_post_accumulate_grad_hook(self._step)
        self._share()
        self.gradient_peak, self._measuring = 0, True

    def _share(self):
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]
        self.state = {p: o.state[p] for p, o in self.optimizers.items()}  # pyright: ignore[reportAttributeAccessIssue]

    def _step(self, p):
        if self._measuring:
            alive = sum(q.grad.untyped_storage().nbytes() for q in self.optimizers if q.grad is not None)
            self.gradient_peak = max(self.gradient_peak, alive)
        optimizer = self.optimizers[p]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self, closure=None):
        """Every parameter was stepped in backward; this ends the first backward's gradient measurement."""
        self._measuring = False
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True):
        for p in self.optimizers:
            p.grad = None

    def state_dict(self) -> dict:
        return {"per_parameter": [o.state_dict() for o in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer, state in zip(self.optimizers.values(), state_dict["per_parameter"], strict=True):
            optimizer.load_state_dict(state)
        self._share()  # load_state_dict gives each optimizer new group and state objects
