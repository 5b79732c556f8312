"""A model's shape from its config.json: parameters exact for the families counted by hand, the rest read off their real modules on the meta device, mixtures of experts group by group."""

import pytest

from memrecipe.errors import RecipeError
from memrecipe.planning.architecture import structure
from model_configs import DENSE_FIRST, MEDIUM, PUBLISHED, SMALL


def test_known_architectures_count_parameters_exactly():
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    configs = [MEDIUM | {"model_type": "qwen2", "tie_word_embeddings": True},
               MEDIUM | {"model_type": "mistral"}, MEDIUM | {"model_type": "qwen3", "head_dim": 64},
               MEDIUM | {"model_type": "gemma", "head_dim": 64},
               {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 3, "vocab_size": 1000, "n_positions": 128},
               {"model_type": "gpt_neox", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3,
                "intermediate_size": 1024, "vocab_size": 1000},
               {"model_type": "phi3", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 3, "intermediate_size": 512, "vocab_size": 1000, "pad_token_id": 0}]
    for config in configs:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        model.tie_weights()  # the meta device skips tying; a real model ties its embeddings
        real = sum(p.numel() for p in model.parameters())
        assert structure(config).params == real, config["model_type"]


def test_unknown_architectures_fall_back_to_the_meta_device():
    config = {"model_type": "opt", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3,
              "ffn_dim": 1024, "vocab_size": 1000, "word_embed_proj_dim": 256, "max_position_embeddings": 128}
    s = structure(config)
    assert s.layers == 3 and s.params > 3 * 4 * 256 * 256 and "meta device" in s.notes[0]
    with pytest.raises(RecipeError, match="not a causal language model"):
        structure({"model_type": "vit", "hidden_size": 64})


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_are_the_published_models(name):
    config, params = PUBLISHED[name]
    s = structure(config)
    assert s.params == params
    if name == "Mixtral-8x7B":  # ZeRO-3 gathers the largest module whole: one layer's fused experts, 1.41B
        assert s.largest_module == 8 * 3 * 14336 * 4096 and (s.experts, s.top_k) == (8, 2)


@pytest.mark.parametrize("kind", sorted(__import__("memrecipe.planning.architecture", fromlist=["LLAMA_LIKE"]).LLAMA_LIKE))
def test_families_counted_by_hand_equal_the_modules_transformers_builds(kind):
    """The hand-counted families (no torch in `plan`) against the real modules on the meta device."""
    from transformers import AutoConfig

    from memrecipe.training.meta import structure_from_meta as _from_meta_device

    config = AutoConfig.for_model(kind, **SMALL).to_dict()
    hand, meta = structure(config), _from_meta_device(config)
    assert "meta device" not in " ".join(hand.notes)
    assert (hand.params, hand.largest_module, hand.head_dim) == (meta.params, meta.largest_module, meta.head_dim)


@pytest.mark.parametrize("kind", DENSE_FIRST)
def test_a_mixture_of_experts_with_dense_first_layers_is_planned_block_by_block(kind):
    """Every block counts, in groups of identical ones: the dense first layer and the routed ones (read as
    blocks[0] x layers, these models were planned without their experts)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **{**SMALL, "num_hidden_layers": 3}, **DENSE_FIRST[kind])
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    s = structure(config.to_dict())
    assert s.params == sum(p.numel() for p in model.parameters())
    assert [(g.layers, g.experts, g.first) for g in s.groups()] == [(1, 0, 0), (2, 4, 1)]
    assert (s.experts, s.top_k, s.layers) == (4, 2, 3) and "1 of its 3 layers are dense" in s.notes[-1]
    experts = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 3)
    assert sum(g.layers * g.expert_params for g in s.groups()) == experts > 0


def test_mfu_counts_the_parameters_a_token_multiplies_by():
    """OLMoE-1B-7B (published: 1.3B active of 6.9B, the input embedding counted): 8 of 64 experts a token, and
    neither model's input embedding (a lookup). MFU over every expert read ~5x too high."""
    import json
    from pathlib import Path

    from model_configs import LLAMA_8B

    olmoe = structure(json.loads((Path(__file__).parents[3] / "benchmarks" / "gpu_configs" / "olmoe-1b-7b.json")
                                 .read_text()))
    embedding = olmoe.vocab * olmoe.hidden
    assert 6.8e9 < olmoe.params < 7.0e9 and 1.25e9 < olmoe.active_params + embedding < 1.35e9
    assert olmoe.params / olmoe.active_params > 5
    llama = structure(LLAMA_8B)
    assert llama.active_params == llama.params - llama.vocab * llama.hidden  # untied: the head multiplies, not the embedding


def test_a_hub_models_config_downloaded_before_is_read_without_the_network(tmp_path, monkeypatch):
    """`plan --model org/name` on a machine that has the model in its hub cache (an offline node) reads the cached
    config.json at once: the hub's client, offline without HF_HUB_OFFLINE, retries ~25 s before falling back to it.
    A model not in the cache still goes to the hub, and its failure is one line."""
    import json

    import huggingface_hub
    from huggingface_hub import constants

    from memrecipe.planning.architecture import read_config

    repo = tmp_path / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(SMALL | {"model_type": "llama"}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    asked = []

    def offline(repo_id, filename, **kwargs):
        asked.append(repo_id)
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert read_config("org/tiny") == SMALL | {"model_type": "llama"} and asked == []
    with pytest.raises(RecipeError, match="cannot read config.json of org/other: not a local folder"):
        read_config("org/other")
    assert asked == ["org/other"]


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "num_hidden_layers": 6, "vocab_size": 64, "max_position_embeddings": 64, "pad_token_id": 0}
WINDOWED = [  # config.json as a user's may hold it: no layer_types, each family's pattern from its config class
    {"model_type": "mistral", "sliding_window": 8}, {"model_type": "mistral", "sliding_window": None},
    {"model_type": "gemma2", "sliding_window": 8, "attn_logit_softcapping": None, "final_logit_softcapping": None},
    {"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 3},
    {"model_type": "gemma3_text", "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"] * 3},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8, "max_window_layers": 2},
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4},
    {"model_type": "smollm3", "use_sliding_window": True, "sliding_window": 8, "no_rope_layer_interval": 2},
    {"model_type": "phi3", "sliding_window": 8}, {"model_type": "llama"},
    {"model_type": "mixtral", "sliding_window": 8, "num_local_experts": 2, "num_experts_per_tok": 1}]  # (meta device)


@pytest.mark.parametrize("config", WINDOWED, ids=lambda c: f"{c['model_type']}-{c.get('sliding_window')}")
def test_each_layers_sliding_window_is_the_mask_transformers_gives_it(config):
    """Sliding-window attention (Mistral, Gemma 2 and 3, the Qwens and SmolLM3 under use_sliding_window, Phi-3,
    Mixtral): the planner reads which layers attend through a window, and how wide, from config.json without
    transformers (architecture.layer_windows; the meta device for Mixtral). Held to the masks transformers' own
    layers get in a row of 16 tokens past an 8-token window, under sdpa (None, its causal shortcut, where the plan
    says full attention) or eager where the model has no sdpa path (Gemma 2): causal, or each query's own key and
    the 7 before it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memrecipe.planning.architecture import layer_windows

    raw = TINY | config
    torch.manual_seed(0)
    built = AutoConfig.for_model(**raw)
    kernel = "sdpa" if AutoModelForCausalLM._model_mapping[type(built)]._supports_sdpa else "eager"
    model = AutoModelForCausalLM.from_config(built, attn_implementation=kernel).eval()
    masks = {}
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda _, args, kwargs, i=index: masks.__setitem__(i, kwargs["attention_mask"]),
                                        with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.arange(1, 17)[None])
    rows, keys = torch.arange(16)[:, None], torch.arange(16)[None]
    seen = []
    for index in range(raw["num_hidden_layers"]):
        mask = masks[index]
        visible = keys <= rows if mask is None else mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
        window = int(visible[-1].sum())  # the last query's keys
        assert torch.equal(visible, (keys <= rows) & (keys > rows - window)), index
        seen.append(0 if window == 16 else window)
    assert layer_windows(raw) == tuple(seen)
    s = structure(raw)
    assert sorted((g.window, g.layers) for g in s.groups()) == sorted((w, seen.count(w)) for w in set(seen))
    assert s.params == structure(raw | {"sliding_window": None, "use_sliding_window": False}).params


@pytest.mark.parametrize("config", WINDOWED, ids=lambda c: f"{c['model_type']}-{c.get('sliding_window')}")
def test_ring_attention_is_refused_before_launch_for_the_models_accelerate_refuses_at_prepare(config):
    """accelerate's ring attention (parallelism.cp_size) drops each layer's mask and runs it causal, so it refuses a
    model with sliding-window layers at prepare, a traceback on the GPU box after the launch
    (big_modeling._attach_context_parallel_hooks, held here to the models it refuses); the plan refuses the same
    models in one line before launch (attention.ring_window_note), and no others."""
    from accelerate import init_empty_weights
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from transformers import AutoConfig, AutoModelForCausalLM

    from memrecipe.planning.planner import estimate
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology

    raw = TINY | config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    try:
        _attach_context_parallel_hooks(model)
        accelerate_refuses = False
    except ValueError as e:
        # (accelerate 1.15's words, then 1.16's: it asks transformers' PreTrainedModel.supports_context_parallel)
        accelerate_refuses = any(words in str(e) for words in ("does not support attention layers",
                                                                 "does not support context parallelism"))
    words = ["packing=false", "per_device_train_batch_size=1", "max_seq_length=64", "lora.dropout=0"]  # (Mixtral's)
    ring = load_recipe("fsdp-lora", [*words, "parallelism.cp_size=8"])
    refused = estimate(ring, structure(raw), Topology(8)).refused or ""
    assert ("ring attention (parallelism.cp_size) runs every layer full causal" in refused) == accelerate_refuses
    assert "ring attention" not in (estimate(load_recipe("fsdp-lora", words), structure(raw), Topology(8)).refused
                                    or "")


@pytest.mark.parametrize("kind", sorted(__import__("memrecipe.planning.architecture", fromlist=["LLAMA_LIKE"]).LLAMA_LIKE
                                        | {"phi3", "gpt2", "gpt_neox"}))
def test_the_kernels_a_family_read_by_hand_has_are_its_classes(kind):
    """architecture.NO_SDPA and NO_FLEX (no torch in `plan`) against transformers' classes: the kernels auto may take
    and a named one is refused without (attention.unsupported_note)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(kind))]
    s = structure(AutoConfig.for_model(kind, **SMALL).to_dict() if kind not in ("gpt2",) else
                  {"model_type": "gpt2", "n_embd": 64, "n_head": 2, "n_layer": 2, "vocab_size": 100, "n_positions": 64})
    assert (s.sdpa, s.flex) == (model_class._supports_sdpa, model_class._supports_flex_attn)
