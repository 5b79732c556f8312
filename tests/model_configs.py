"""config.json contents of the models the tests plan for and build: one place for each."""

MEDIUM = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
          "intermediate_size": 1408, "vocab_size": 32000, "num_hidden_layers": 8, "max_position_embeddings": 512,
          "tie_word_embeddings": False}  # ~55M parameters

TINY_MIXTRAL = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 224,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
            "max_position_embeddings": 131072, "head_dim": 128}

# Published configs (the hub's config.json keys the planner reads) and their models' true parameter counts.
PUBLISHED = {
    "Mixtral-8x7B": ({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
                      "tie_word_embeddings": False}, 46_702_792_704),
    "Qwen2.5-7B": ({"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "tie_word_embeddings": False}, 7_615_616_512),
    "Gemma-2-9B": ({"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
                    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "tie_word_embeddings": True}, 9_241_705_984),
    "Llama-3.1-8B": ({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                      "tie_word_embeddings": False}, 8_030_261_248),
}

SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None}

# mixtures of experts whose first layers are dense (DeepSeek-V3: 3 of 61, GLM-4.5-style, Qwen-MoE's mlp_only_layers)
DENSE_FIRST = {
    "qwen2_moe": {"mlp_only_layers": [0], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
    "deepseek_v3": {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16},
}
LLAMA_70B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}


def model_folder(folder, config):
    """A model folder for the checks before a launch: its config.json, the embedded model's tokenizer, and a weights
    file that holds no tensor (a whole safetensors file by its header, which is all they read), so a model too big
    to build here can be given."""
    import json

    from memrecipe.planning.registry import EMBEDDED_MODEL

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    stub_weights(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_text((EMBEDDED_MODEL / name).read_text())
    return folder


def stub_weights(folder):
    """A model.safetensors that holds no tensor: whole by its header (the weights check reads nothing more)."""
    header = b'{"__metadata__": {}}'
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)

MOE_LORA = ["lora.dropout=0.0"]  # peft's LoRA on fused experts (ParamWrapper) takes no dropout
