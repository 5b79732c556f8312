"""Tiled MLP: each decoder layer's MLP runs over the sequence a tile of tokens at a time and is recomputed tile by tile
in backward, so its [tokens x intermediate] tensors exist for one tile at a time (DeepSpeed's ALST idea). Written here
rather than taken from deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP, whose backward recomputes outside
the forward's autocast (bf16 autocast over frozen bf16 weights and fp32 adapters then fails: "expected m1 and m2 to
have the same dtype") and without the forward's random state (LoRA's dropout would draw other masks).

Under DeepSpeed with several processes two of its rules are kept, as its TiledMLP keeps them: every process runs the
same number of tiles (ZeRO-3 gathers a weight at each module call, a collective: the count is agreed as the largest),
and a weight's gradient is marked not ready (`ds_grad_is_ready`, read by ZeRO's gradient hooks, stage3.py and
stage_1_and_2.py) until its last tile, so ZeRO reduces it once, whole."""

from __future__ import annotations

import functools
import inspect

import torch

from ..errors import RecipeError
from ..planning.activations import tile_count
from .adapters import dropped, dropped_forward
from .layers import RECOMPUTING, TILING


class TiledMLP(torch.autograd.Function):
    """y = mlp(x), computed a tile of tokens at a time without keeping anything but x; backward recomputes each
    tile under the forward's autocast and random state and sums the parameters' gradients over the tiles.
    `idle_in_recompute`: in a checkpoint's recompute of its layer (layers.RECOMPUTING) only x is saved again and y is a
    zero that takes no memory: backward recomputes every tile anyway, and nothing after the MLP saves y or draws a
    random number (mlp_output_unsaved). Computed there, y's tiles and their concatenation were two [tokens x hidden]
    tensors beside everything the layer saved, the top rung's peak under flex_attention (the fourth lease's 384K and
    751K rows, 1.06-1.08x the plan), and one more forward of the MLP.
    `params`: under DeepSpeed, the trained weights the tiles read, each marked not ready until the last tile.
    `trains`: where the tiles read a trained weight, an empty tensor that requires grad, so that y does too where x
    does not (the first layer's q, k and v read the frozen embedding's normed output: their adapters' A trained
    nothing, and an MLP-only LoRA's loss had no gradient at all). Not the weights themselves: each would then have
    its gradient accumulated once more, empty, after the tiles', and ZeRO would take it twice."""

    @staticmethod
    def forward(ctx, forward, x, tiles, params, idle_in_recompute=False, trains=None):
        ctx.save_for_backward(x)
        if idle_in_recompute and RECOMPUTING.get():  # (this ctx is thrown away: only x, saved again, is kept)
            return x.new_zeros(()).expand(x.shape)
        device = x.device.type
        ctx.forward, ctx.tiles, ctx.device, ctx.params = forward, tiles, device, params
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.states = []
        outputs = []
        for part in x.reshape(-1, x.shape[-1]).chunk(tiles):
            ctx.states.append(random_state(x.device))
            outputs.append(forward(part))
        return torch.cat(outputs).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        flat, grads = x.detach().reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        # x's gradient is written tile by tile into one tensor (each tile's leaf accumulates into its slice, in
        # place), as DeepSpeed's TiledMLP does: gathering the tiles' gradients and concatenating them would hold
        # the input's gradient twice at the end
        x_grad = torch.zeros_like(flat) if x.requires_grad else None
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=[x.device] if ctx.device == "cuda" else [], device_type=ctx.device):
            slices = x_grad.chunk(ctx.tiles) if x_grad is not None else [None] * len(ctx.states)
            tiles = list(zip(flat.chunk(ctx.tiles), grads.chunk(ctx.tiles), slices, ctx.states))
            for i, (part, tile_grad, grad_slice, state) in enumerate(tiles):
                for param in ctx.params:  # (DeepSpeed: reduce each gradient once, after the last tile)
                    param.ds_grad_is_ready = i == len(tiles) - 1
                set_random_state(x.device, state)
                leaf = part.detach().requires_grad_(x.requires_grad)
                leaf.grad = grad_slice
                with torch.enable_grad(), torch.autocast(ctx.device, dtype=dtype, enabled=enabled):
                    # through a view, as in the model: autocast caches the half cast of a leaf, and the gradients
                    # of its uses would then be summed in 16 bits instead of 32
                    output = ctx.forward(leaf.view_as(leaf))
                torch.autograd.backward(output, tile_grad)
        return None, x_grad.view_as(x) if x_grad is not None else None, None, None, None, None


def random_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_random_state(device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def tiled_forward(forward, tiles, x, params=(), mark=False, agree=False, idle_in_recompute=False):
    """`params`: the MLP's trained weights; `mark`: under DeepSpeed, which waits for their last tile; `agree`: several
    processes, which must run as many tiles as each other; `idle_in_recompute`: TiledMLP's."""
    n = tile_count(tiles, x.numel() // x.shape[-1], x.shape[-1])
    if agree:  # every process the same count: ZeRO-3 gathers the weights at each tile's calls
        agreed = torch.tensor(n, device=x.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        n = int(agreed)
    token = TILING.set(True)  # (selective checkpointing keeps none of the MLP's matmuls: layers.selective_policy)
    try:
        return forward(x) if n == 1 else tiled(forward, x, n, params, mark, idle_in_recompute)
    finally:
        TILING.reset(token)


def tiled(forward, x, tiles, params, mark, idle_in_recompute=False):
    """TiledMLP over `tiles` tiles of x, reading the trained `params` (`mark`: under DeepSpeed)."""
    trains = x.new_empty(0).requires_grad_() if params and torch.is_grad_enabled() else None  # (eval: no graph)
    return TiledMLP.apply(forward, x, tiles, list(params) if mark else [], idle_in_recompute, trains)


@functools.cache
def _mlp_output_unsaved(layer_class) -> bool:
    try:
        source = inspect.getsource(layer_class.forward)
    except (OSError, TypeError):
        return False
    _, found, after = source.partition("self.mlp(hidden_states)")
    rest = [line.strip() for line in after.splitlines() if line.strip()]
    return bool(found) and rest == ["hidden_states = residual + hidden_states", "return hidden_states"]


def mlp_output_unsaved(layer) -> bool:
    """Whether the decoder layer's code after its MLP is the residual add alone (Llama's, and the models transformers
    copies it to: Qwen, Mistral, ...), so that nothing saves the MLP's output or draws a random number after it.
    Gemma's and OLMo 2's norm after the MLP saves its input: their recompute runs the MLP. (Read once a class.)"""
    return _mlp_output_unsaved(type(layer))


def tile_mlps(model, tiles: bool | int, deepspeed: bool = False, checkpointed: bool = False) -> int:
    """Each decoder layer's dense MLP (a module named `mlp` whose class is an MLP: LlamaMLP, Qwen2MLP, ...) runs
    tiled; returns how many. A model whose layers route tokens to experts instead is refused in one line. Several
    processes only under DeepSpeed (`deepspeed`), told to wait for a weight's last tile. `checkpointed`: the layers
    are recomputed whole by the loop's checkpointing (layers.marked), where an MLP whose output nothing saves is left
    out (TiledMLP); under DeepSpeed too, whose recompute stops early at the MLP's save, after the MLP ran."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    several = distributed and torch.distributed.get_world_size() > 1
    if several and not deepspeed:
        raise RecipeError("tiled_mlp runs on one process or under DeepSpeed: DDP syncs each weight's gradient once, "
                          "and the tiles give it in parts: launch 1 process, or set tiled_mlp=false")
    mlps = {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"}
    dense = {name: m for name, m in mlps.items() if type(m).__name__.endswith("MLP")}
    if not dense or len(dense) < len(mlps):
        kinds = sorted({type(m).__name__ for name, m in mlps.items() if name not in dense}) or ["no module named mlp"]
        raise RecipeError(f"tiled_mlp tiles dense MLPs; this model's layers have {', '.join(kinds)}: "
                          "set tiled_mlp=false")
    for name, mlp in dense.items():  # (ZeRO's gradient hooks run on one process too)
        params = [p for p in mlp.parameters() if p.requires_grad]
        idle = checkpointed and mlp_output_unsaved(model.get_submodule(name.rpartition(".")[0]))
        mlp.forward = functools.partial(tiled_forward, mlp.forward, tiles, params=params, mark=deepspeed,
                                        agree=several, idle_in_recompute=idle)
    return len(dense)


def tile_redraws(model, tiles: bool | int, deepspeed: bool = False) -> int:
    """Each LoRA adapter outside the MLPs whose dropout is redrawn in backward (training.adapters.recompute_dropout:
    o_proj's, q's, k's and v's) redraws it a tile of tokens at a time: its input's cast, mask and dropped input (9
    bytes x its width a token on CUDA with fp32 adapters) exist for one tile, not the whole sequence, which bound the
    top rung under LoRA's dropout (the third lease's flex_attention row: 9.0 of 14.1 GiB). Returns how many. Under
    DeepSpeed (`deepspeed`) the adapter's weight is marked not ready until the last tile, as the MLP's are (ZeRO took
    the first tile's gradient for the whole one: stage3.py asserts a parameter once a bucket); no process need agree
    on a count of tiles, as a tile calls no module (the weight is gathered once, for the adapter's own call)."""
    count = 0
    for name, module in model.named_modules():
        redraw = getattr(module, "forward", None)
        if not (isinstance(redraw, functools.partial) and redraw.func is dropped_forward) or ".mlp." in f".{name}.":
            continue
        module.forward = functools.partial(tiled_redraw, *redraw.args, tiles, deepspeed)
        count += 1
    return count


def tiled_redraw(linear, casts, tiles, mark, x):
    n = tile_count(tiles, x.numel() // x.shape[-1], x.shape[-1])
    if n == 1:
        return dropped_forward(linear, casts, x)
    params = [p for p in linear.parameters() if p.requires_grad]
    return tiled(functools.partial(dropped, linear, casts()), x, n, params, mark)


def apply(model, recipe, accelerator) -> int:
    """The tiled MLP rung (planning/rungs.py): every dense MLP in tiles of tokens, and LoRA's redrawn dropout outside
    them; returns how many MLPs."""
    deepspeed = accelerator.distributed_type.value == "DEEPSPEED"
    tile_redraws(model, recipe.tiled_mlp, deepspeed=deepspeed)
    return tile_mlps(model, recipe.tiled_mlp, deepspeed=deepspeed, checkpointed=recipe.recompute_skips_tiles)
