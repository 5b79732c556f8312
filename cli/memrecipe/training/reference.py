"""DPO's reference model where it is a second model: a frozen copy of the initial one, loaded as the policy is
and sharded or partitioned like it."""

from __future__ import annotations

from .loading import load_pretrained


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
