"""A model's shape from its config.json alone: parameter tensors, layers, what LoRA can target.

Plain Python (json): no torch, no weights. Known families are read directly; any other causal
LM falls back to building it on the meta device (that path imports torch and transformers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import RecipeError
from .paths import read_adapter
from .registry import EMBEDDED_MODEL

EMBEDDED_CONFIG = EMBEDDED_MODEL / "config.json"
# Counted by hand (no torch needed, so `plan` stays fast): the families whose counts equal the modules transformers
# builds (tests/unit/planning/test_architecture.py checks each). Others, mixtures of experts among them, are read
# from the real modules on the meta device.
# model types whose RMSNorm is transformers' LlamaRMSNorm op for op: the norms lean_norms replaces (at load,
# training.norms.is_llama_norm decides; tests/unit/training/test_norms.py holds the two equal). Gemma's adds 1 to its
# weight and OLMo2's casts elsewhere: lean_norms leaves theirs as they are, and the plan counts them so.
LEAN_NORM_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmoe", "granite",
                   "granitemoe", "smollm3", "phi3", "deepseek_v3", "glm4"}
# attention that normalises its query and key before RoPE (transformers' q_norm/k_norm): per head (Qwen3, Gemma 3) or
# over the whole projection (OLMo 2)
QK_NORMED = {"qwen3": "head", "gemma3_text": "head", "olmo2": "projection"}
# layers with a norm before and after both attention and the MLP (four hidden-wide norms; Llama's have two)
SANDWICH_NORMED = {"gemma2", "gemma3_text"}
# layers that normalise the MLP's output before the residual add (post_feedforward_layernorm): its backward runs
# first, beside everything the layer saved (training.tiling.mlp_output_unsaved reads the same off the layer's code)
NORM_AFTER_MLP = {"gemma2", "gemma3_text", "olmo2"}
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "smollm3"}
# the read-by-hand families whose layers may attend through a sliding window, and the window their config class
# takes where config.json names none (transformers 5's configuration_*.py); the Qwens and SmolLM3 only under
# use_sliding_window
SLIDING_WINDOW = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma2": 4096, "gemma3_text": 4096, "smollm3": None,
                  "phi3": None}
FLAGGED_WINDOW = {"qwen2", "qwen3", "smollm3"}
# the read-by-hand families whose transformers 5 class has no sdpa path (Gemma 2: its soft-capped scores) or no
# flex_attention path (_supports_sdpa, _supports_flex_attn; test_architecture.py holds both to the classes)
NO_SDPA = {"gemma2"}
NO_FLEX = {"gpt2"}


@dataclass(frozen=True)
class Linear:
    name: str  # the module name LoRA targets (q_proj, c_attn, ...)
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class Tensor:
    """One trained parameter tensor as an optimizer sees it."""

    name: str  # its module's name (q_proj, lm_head, embed_tokens, norm)
    shape: tuple[int, ...]
    kind: str  # "embedding", "linear" (a weight matrix of an nn.Linear), or "other" (norms, biases, adapters)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Structure:
    """What the planner needs to know of a decoder-only transformer."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated_mlp: bool  # SwiGLU/GeGLU (gate, up, down) vs a plain two-layer MLP
    linears: tuple[Linear, ...]  # one decoder layer's linear layers
    layer_norm_params: tuple[int, ...]  # one decoder layer's other tensors (norms), as numels
    top_params: tuple[int, ...]  # embeddings, position embeddings, final norm, untied lm_head
    tied_embeddings: bool
    llama_like: bool = True  # activation formulas measured on this family (others: same counting rules)
    notes: tuple[str, ...] = field(default=())
    # mixture of experts: experts per layer held as fused [experts x ...] tensors (transformers 5), each
    # token routed to `top_k` of them; `intermediate` is then one expert's
    experts: int = 0
    top_k: int = 0
    expert_params: int = 0  # one layer's fused expert tensors
    largest: int = 0  # the largest module's own parameters, when read off the real modules (0: from linears)
    config: dict | None = field(default=None, compare=False, hash=False, repr=False)  # a meta-device model's config
    # decoder layers that differ (a mixture of experts whose first layers are dense): each group of identical
    # layers as a Structure of its own (`layers`: how many, `first`: the first one's index); empty: all alike
    blocks: tuple[Structure, ...] = ()
    first: int = 0
    # sliding-window attention: each query attends to itself and the `window - 1` keys before it (0: to all before
    # it); a model whose layers differ (Gemma 2's and 3's) holds each kind as a group of `blocks`
    window: int = 0
    # the attention kernels transformers' class for this model runs (flash-attn's is taken where it is installed)
    sdpa: bool = True
    flex: bool = True
    attention_dropout: float = 0.0  # (transformers' flex path and the query chunks refuse it)

    def groups(self) -> tuple[Structure, ...]:
        """The decoder layers in groups of identical ones; read each group's per-layer fields (linears, norms,
        experts, intermediate) and its `layers` count, never its top_params."""
        return self.blocks or (self,)

    def masked_windows(self, seq: int) -> tuple[int, ...]:
        """The sliding windows of the groups whose rows of `seq` tokens reach past them (reached_windows)."""
        return reached_windows((g.window for g in self.groups()), seq)

    @property
    def lean_norms_apply(self) -> bool:
        """Whether lean_norms replaces this model's norms (LEAN_NORM_TYPES)."""
        return self.model_type in LEAN_NORM_TYPES

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qk_norms(self) -> tuple[int, int]:
        """(elements, rows) a token's query and key normalisation reads (QK_NORMED): per head, a row of head_dim
        each; over the projection, one row each. (0, 0) for attention without them."""
        over = QK_NORMED.get(self.model_type)
        width = (self.heads + self.kv_heads) * self.head_dim
        return (0, 0) if over is None else (width, self.heads + self.kv_heads if over == "head" else 2)

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters (of this group; see `groups`)."""
        return sum(lin.params for lin in self.linears) + sum(self.layer_norm_params)

    @property
    def largest_layer_params(self) -> int:
        return max(g.layer_params for g in self.groups())

    @property
    def params(self) -> int:
        return sum(g.layers * g.layer_params for g in self.groups()) + sum(self.top_params)

    @property
    def active_params(self) -> int:
        """The parameters one token's forward multiplies by (MFU's N): a routed layer's experts at top_k of
        `experts`, the input embedding left out (a lookup, not a matmul), a tied head counted once, as the head."""
        routed = sum(g.layers * g.expert_params * (g.experts - g.top_k) // g.experts for g in self.groups() if g.experts)
        return self.params - routed - (0 if self.tied_embeddings else self.vocab * self.hidden)

    def layer_tensors(self) -> list[Tensor]:
        """One decoder layer's parameter tensors (of this group)."""
        per_layer = [Tensor(lin.name, (lin.out_features, lin.in_features), "linear") for lin in self.linears]
        per_layer += [Tensor(lin.name, (lin.out_features,), "other") for lin in self.linears if lin.bias]
        return per_layer + [Tensor("norm", (n,), "other") for n in self.layer_norm_params]

    def tensors(self) -> list[Tensor]:
        """Every parameter tensor (biases separate), as an optimizer sees them. Of the tensors outside the
        layers the first is the token embedding, a second [vocab x hidden] one the untied head; the others
        (final norm, learned positions) count by size alone."""
        top = [Tensor("embed_tokens", (self.vocab, self.hidden), "embedding")]
        for n in self.top_params[1:]:
            head = n == self.vocab * self.hidden and not self.tied_embeddings
            top.append(Tensor("lm_head", (self.vocab, self.hidden), "linear") if head else Tensor("other", (n,), "other"))
        return [t for g in self.groups() for t in g.layer_tensors() * g.layers] + top

    @property
    def largest_module(self) -> int:
        """Largest single module's parameters (DeepSpeed's `largest_layer_params`): a fused experts module
        holds all its experts."""
        return self.largest or max([lin.params for lin in self.linears] + list(self.top_params))

    @property
    def root_params(self) -> int:
        """What stays in FSDP's root unit when each decoder layer is its own unit."""
        return sum(self.top_params)

    def in_mlp(self, lin: Linear) -> bool:
        """Whether a decoder-layer linear is its MLP's (reads or writes the intermediate width)."""
        return self.intermediate in (lin.in_features, lin.out_features)

    def lora_linears(self, targets) -> list[Linear]:
        """The decoder-layer linears a LoRA `target_modules` picks (peft's all-linear: all but lm_head)."""
        if targets == "all-linear":
            return list(self.linears)
        wanted = set(targets)
        picked = [lin for lin in self.linears if lin.name in wanted]
        if not picked:
            names = ", ".join(sorted({lin.name for lin in self.linears}))
            raise RecipeError(f"lora.target_modules {sorted(wanted)} match no layer of this {self.model_type} model; "
                              f"its linear layers: {names} (or all-linear)")
        return picked


def _load_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): a saved config is") from None
    if not isinstance(config, dict):
        raise RecipeError(f"{path} holds a JSON {type(config).__name__}, not a config (a JSON object)")
    return config


def read_config(model: str | None) -> dict:
    """config.json of a local folder, a hub id (that file alone), or the embedded default (None)."""
    if model is None:
        return json.loads(EMBEDDED_CONFIG.read_text())
    path = Path(model).expanduser()
    if path.is_dir():
        if (adapter := read_adapter(model)) and adapter.get("base_model_name_or_path"):
            return read_config(adapter["base_model_name_or_path"])  # the base the adapter applies to
        if not (path / "config.json").is_file():
            raise RecipeError(f"{model} has no config.json")
        return _load_json(path / "config.json")
    if path.suffix == ".json" and path.is_file():
        return _load_json(path)
    if model.startswith((".", "/", "~")):
        raise RecipeError(f"model path {model} does not exist")
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json")  # downloaded before: no network (the hub's client, offline
    if isinstance(cached, str):                             # without HF_HUB_OFFLINE, retries ~25 s before using it)
        return _load_json(Path(cached))
    try:
        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as e:  # offline, unknown id, gated: one line
        text = " ".join(str(e).split()).lower()
        if "gated" in text or "401" in text:
            raise RecipeError(f"model {model} is gated: accept its licence on the hub and set HF_TOKEN") from None
        raise RecipeError(f"cannot read config.json of {model}: not a local folder, and the hub did not give it "
                          "(offline, or a typo?)") from None


def structure(config: dict) -> Structure:
    """The Structure of a config dict; multimodal configs use their text part. A config that lacks a
    key its architecture needs is refused in one line, naming the key."""
    try:
        return _structure(config)
    except KeyError as e:
        kind = config.get("model_type", "?")
        raise RecipeError(f"the model's config.json ({kind}) lacks {e.args[0]}, which the planner needs: is it a "
                          "complete causal LM config?") from None


def _structure(config: dict) -> Structure:
    config = config.get("text_config", config) if "text_config" in config and "vocab_size" not in config else config
    kind = config.get("model_type", "")
    readers = {"phi3": _phi3, "gpt2": _gpt2, "gpt_neox": _gpt_neox} | dict.fromkeys(LLAMA_LIKE, _llama_like)
    if kind not in readers:
        return _from_meta_device(config)
    s = replace(readers[kind](config), sdpa=kind not in NO_SDPA, flex=kind not in NO_FLEX,
                attention_dropout=float(config.get("attention_dropout") or 0))
    return windowed(s, layer_windows(config))


def layer_windows(c: dict) -> tuple[int, ...]:
    """Each decoder layer's sliding window (Structure.window; 0: full attention), as transformers' config classes
    resolve a config.json: its layer_types where it gives them, else the family's pattern (Gemma 2: every other
    layer from the first; Gemma 3: five of every sliding_window_pattern, 6; the Qwens: from max_window_layers on;
    SmolLM3: the layers without rotary positions), and every layer of the families that take one window for all
    (Mistral, Phi-3, and any family read off the meta device without layer_types: Mixtral, Starcoder2).
    tests/unit/planning/test_architecture.py holds each to the masks transformers' own layers get."""
    kind, n = c.get("model_type", ""), c.get("num_hidden_layers") or len(c.get("layer_types") or ())
    window = c.get("sliding_window", SLIDING_WINDOW.get(kind))
    if not window or (kind in FLAGGED_WINDOW and not c.get("use_sliding_window", False)):
        return (0,) * n
    types = c.get("layer_types")
    if types is None:
        sliding = {"gemma2": lambda i: (i + 1) % 2 != 0,
                   "gemma3_text": lambda i: (i + 1) % c.get("sliding_window_pattern", 6) != 0,
                   "qwen2": lambda i: i >= c.get("max_window_layers", 28),
                   "qwen3": lambda i: i >= c.get("max_window_layers", 28),
                   "smollm3": lambda i: not (c.get("no_rope_layers") or [
                       int((j + 1) % c.get("no_rope_layer_interval", 4) != 0) for j in range(n)])[i]}.get(kind)
        types = ["sliding_attention" if sliding is None or sliding(i) else "full_attention" for i in range(n)]
    return tuple(window if layer == "sliding_attention" else 0 for layer in types)


def reached_windows(windows, seq: int) -> tuple[int, ...]:
    """Of these sliding windows (0: full attention), those rows of `seq` tokens reach: under sdpa their layers get a
    dense [S x S] mask (masking_utils._ignore_causal_mask_sdpa keeps it from kv_length >= window)."""
    return tuple(sorted({w for w in windows if 0 < w <= seq}))


def windowed(s: Structure, windows: tuple[int, ...]) -> Structure:
    """`s` (its layers alike) with each layer's sliding window: one window for all, or a group of `blocks` for
    each (their first layer's index in `first`)."""
    if len(set(windows)) == 1:
        return replace(s, window=windows[0])
    groups = {w: windows.index(w) for w in windows}
    return replace(s, blocks=tuple(replace(s, layers=windows.count(w), window=w, first=first)
                                   for w, first in groups.items()))


def _llama_like(c: dict) -> Structure:
    kind, h = c["model_type"], c["hidden_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    d = c.get("head_dim") or h // heads
    i = c["intermediate_size"]
    qkv_bias = bool(c.get("attention_bias", kind == "qwen2"))
    mlp_bias = bool(c.get("mlp_bias", False))
    linears = (Linear("q_proj", h, heads * d, qkv_bias), Linear("k_proj", h, kv * d, qkv_bias),
               Linear("v_proj", h, kv * d, qkv_bias), Linear("o_proj", heads * d, h, bool(c.get("attention_bias", False))
                                                               and kind != "qwen2"),
               Linear("gate_proj", h, i, mlp_bias), Linear("up_proj", h, i, mlp_bias), Linear("down_proj", i, h, mlp_bias))
    norms = [h, h] + ([h, h] if kind in ("gemma2", "gemma3_text") else []) + ([d, d] if kind in ("qwen3", "gemma3_text", "olmo2") else [])
    if kind == "olmo2":
        norms = [h, h, heads * d, kv * d]  # post-norms, q/k norms over the full projection
    tied = bool(c.get("tie_word_embeddings", kind.startswith("gemma")))
    top = [c["vocab_size"] * h, h] + ([] if tied else [c["vocab_size"] * h])
    return Structure(kind, c["vocab_size"], h, c["num_hidden_layers"], heads, kv, d, i, True, linears, tuple(norms),
                     tuple(top), tied)


def _phi3(c: dict) -> Structure:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    d, i = h // heads, c["intermediate_size"]
    linears = (Linear("qkv_proj", h, (heads + 2 * kv) * d), Linear("o_proj", heads * d, h),
               Linear("gate_up_proj", h, 2 * i), Linear("down_proj", i, h))
    tied = bool(c.get("tie_word_embeddings", False))
    top = [c["vocab_size"] * h, h] + ([] if tied else [c["vocab_size"] * h])
    return Structure("phi3", c["vocab_size"], h, c["num_hidden_layers"], heads, kv, d, i, True, linears, (h, h),
                     tuple(top), tied)


def _gpt2(c: dict) -> Structure:
    h, heads = c["n_embd"], c["n_head"]
    i = c.get("n_inner") or 4 * h
    linears = (Linear("c_attn", h, 3 * h, True), Linear("c_proj", h, h, True), Linear("c_fc", h, i, True),
               Linear("c_proj", i, h, True))
    top = (c["vocab_size"] * h, c["n_positions"] * h, 2 * h)  # tied lm_head
    return Structure("gpt2", c["vocab_size"], h, c["n_layer"], heads, heads, h // heads, i, False, linears,
                     (2 * h, 2 * h), top, True, llama_like=False)


def _gpt_neox(c: dict) -> Structure:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    i = c["intermediate_size"]
    linears = (Linear("query_key_value", h, 3 * h, True), Linear("dense", h, h, True),
               Linear("dense_h_to_4h", h, i, True), Linear("dense_4h_to_h", i, h, True))
    tied = bool(c.get("tie_word_embeddings", False))
    top = [c["vocab_size"] * h, 2 * h] + ([] if tied else [c["vocab_size"] * h])
    return Structure("gpt_neox", c["vocab_size"], h, c["num_hidden_layers"], heads, heads, h // heads, i, False,
                     linears, (2 * h, 2 * h), tuple(top), tied, llama_like=False)


def _from_meta_device(c: dict) -> Structure:
    """Any other causal LM, read from its real modules on the meta device. The one place the planning side
    reaches for torch (lazily, only for a model type without a reader above): memrecipe.training.meta."""
    from ..training.meta import structure_from_meta

    return structure_from_meta(c)


def lora_tensors_on_meta(c: dict, lora) -> list[Tensor]:
    """What peft's LoRA trains on the real modules of a config (on the meta device): on a mixture of
    experts peft also wraps the fused expert tensors and the router (ParamWrapper, all-linear), with
    shapes of its own, so the adapters are read off peft rather than counted from the linears."""
    from ..training.meta import lora_tensors

    return list(lora_tensors(json.dumps(c, sort_keys=True), lora))
