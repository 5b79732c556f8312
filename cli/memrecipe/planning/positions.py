"""The positions a model knows and the recipe's rope_scaling: what a run at max_seq_length asks of RoPE, said by `plan`
and `run` before a launch, and the rope_parameters the loop writes into the model's config as it loads (torch-free:
read from the config.json)."""

from __future__ import annotations


def known_positions(config: dict) -> int | None:
    """The model's max_position_embeddings (its text config's, for a model with several)."""
    text = config.get("text_config") or config
    return text.get("max_position_embeddings") or config.get("max_position_embeddings")


def rope_parameters(recipe, config: dict) -> dict | None:
    """The model config's rope_parameters with the recipe's rope_scaling applied (its rope_theta kept), and the
    positions they reach as `max_position_embeddings`; None without rope_scaling (the model's own RoPE)."""
    scaling, known = recipe.rope_scaling, known_positions(config)
    if scaling is None:
        return None
    original = scaling.original_max_position_embeddings or known or recipe.max_seq_length
    factor = scaling.factor or max(1.0, recipe.max_seq_length / original)
    text = config.get("text_config") or config
    theta = (text.get("rope_parameters") or {}).get("rope_theta") or text.get("rope_theta") or 10000.0
    return {"rope_type": scaling.rope_type, "factor": float(factor), "original_max_position_embeddings": original,
            "rope_theta": theta, "max_position_embeddings": int(original * factor)}


def positions_note(recipe, config: dict) -> str | None:
    """One line when the run's rows pass the positions the model knows (or reaches with rope_scaling), or what
    rope_scaling makes of them; None when max_seq_length is within the model's own positions."""
    known, rope = known_positions(config), rope_parameters(recipe, config)
    length = recipe.max_seq_length
    if rope is not None:
        reach = rope["max_position_embeddings"]
        said = (f"rope_scaling: {rope['rope_type']} x{rope['factor']:g} from {rope['original_max_position_embeddings']:,} "
                f"positions, to {reach:,}")
        return said + (f"; max_seq_length {length:,} still passes them: raise rope_scaling.factor to "
                       f"{length / rope['original_max_position_embeddings']:.3g}" if length > reach else "")
    if known and length > known:
        return (f"max_seq_length {length:,} passes the model's max_position_embeddings {known:,}: positions past it "
                f"were never trained; rope_scaling.rope_type=yarn scales RoPE to them (factor "
                f"{length / known:.3g}, from the ratio, unless rope_scaling.factor says)")
    return None
