"""Recipe x Topology -> accelerate YAML (+ DeepSpeed JSON). Pure functions: dicts and text in, out.

Micro batch, gradient accumulation, precision and clipping are defined once, in the Recipe,
and written where the engines read them: with DeepSpeed they live in the JSON only (accelerate
refuses them twice); otherwise precision is in the accelerate YAML, and the loop passes
accumulation and clipping to the Accelerator. No "auto" values are left for accelerate to fill,
and nothing assumes a world size the file cannot know (no train_batch_size).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

import yaml

from .recipe import Recipe
from .topology import Topology, resolve_precision

DISTRIBUTED_TYPE = {"no": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}

# Why each generated key is there: written as a comment beside it.
WHY = {
    "compute_environment": "plain machines (not SageMaker)",
    "distributed_type": "how the processes share the work",
    "num_processes": "total processes over all machines (one per GPU)",
    "num_machines": "machines taking part",
    "machine_rank": "this machine's index (0 = the one holding the rendezvous)",
    "main_process_ip": "address of machine rank 0",
    "main_process_port": "rendezvous port on machine rank 0",
    "rdzv_backend": "c10d: torch's rendezvous on machine 0 (launch reads it from --rdzv_backend only)",
    "same_network": "false: every machine meets at main_process_ip:port (with c10d, true means localhost)",
    "mixed_precision": "from the recipe's mixed_precision, resolved for this machine",
    "use_cpu": "true: CPU smoke-test mode, gloo (the Run line above says how to launch it)",
    "fsdp_version": "2: per-parameter sharding (DTensor), the current API; 1: flat parameters",
    "fsdp_auto_wrap_policy": "one FSDP unit per decoder layer",
    "fsdp_reshard_after_forward": "true: full shard (ZeRO-3 like); false: keep params after forward (ZeRO-2 like)",
    "fsdp_sharding_strategy": "FSDP1: FULL_SHARD (ZeRO-3 like) or SHARD_GRAD_OP (ZeRO-2 like)",
    "fsdp_backward_prefetch": "FSDP1: fetch the next layer during backward (speed, one layer of memory)",
    "fsdp_use_orig_params": "FSDP1: true keeps parameter identity; false: flat parameters (less memory)",
    "fsdp_transformer_layer_cls_to_wrap": "wrap these classes (default: the model's _no_split_modules)",
    "fsdp_offload_params": "parameters and optimizer state in host RAM",
    "fsdp_state_dict_type": "how accelerate gathers state dicts at save",
    "fsdp_cpu_ram_efficient_loading": "only rank 0 loads the weights, then broadcasts",
    "fsdp_sync_module_states": "broadcast rank 0's weights (needed by cpu_ram_efficient_loading)",
    "fsdp_activation_checkpointing": "recompute each layer in backward instead of storing activations",
    "parallelism_config_dp_replicate_size": "no replicas: one data-parallel group (HSDP would replicate)",
    "parallelism_config_dp_shard_size": "data-parallel processes: num_processes / tp_size (or sp_size, cp_size)",
    "parallelism_config_tp_size": "tensor parallel degree: each layer split this many ways",
    "parallelism_config_cp_size": "ring attention's degree: each sequence split this many ways (1: none)",
    "parallelism_config_cp_backend": "torch's context_parallel (ring attention over SDPA's CUDA kernels)",
    "parallelism_config_cp_comm_strategy": "allgather: each layer gathers every process's keys and values once "
                                           "(alltoall passes them on step by step: less memory, more latency)",
    "parallelism_config_sp_size": "Ulysses sequence parallel degree: each sequence split this many ways",
    "parallelism_config_sp_backend": "DeepSpeed's Ulysses (UlyssesSPAttentionHF), registered by accelerate's prepare",
    "parallelism_config_sp_seq_length_is_variable": "rows are padded per batch, so their length varies",
    "parallelism_config_sp_attn_implementation": "the kernel each process runs on whole sequences (the model's own)",
    "deepspeed_config_file": "ZeRO settings, batch, accumulation, precision, clipping live there",
    "zero3_init_flag": "build the model already partitioned (ZeRO-3): no full copy per process",
    "deepspeed_multinode_launcher": "standard: each machine runs its own launcher (no pdsh/ssh)",
}


def sp_attention(recipe: Recipe) -> str:
    """The attention kernel under Ulysses: flash_attention_2 where the recipe names it, else sdpa (accelerate refuses
    eager and flex_attention there, and `auto` cannot know at config time whether flash-attn is installed)."""
    return "flash_attention_2" if recipe.attn_implementation == "flash_attention_2" else "sdpa"


def config_name(recipe: Recipe, topo: Topology) -> str:
    """zero3-offload on 8 GPUs -> zero3_offload_8gpu (file stem in accelerate_configs/)."""
    return f"{recipe.name.replace('-', '_')}_{topo.name.replace('-', '_')}"


def deepspeed_config(recipe: Recipe, topo: Topology) -> dict | None:
    """The DeepSpeed JSON as a dict, or None for recipes that do not use DeepSpeed."""
    ds = recipe.deepspeed
    if ds is None:
        return None
    precision = resolve_precision(recipe, topo)
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": ds.offload_optimizer, "pin_memory": ds.pin_memory}
    if ds.offload_param != "none":
        zero["offload_param"] = {"device": ds.offload_param, "pin_memory": ds.pin_memory}
    if ds.zero_stage >= 2:
        zero |= {"overlap_comm": ds.overlap_comm, "contiguous_gradients": ds.contiguous_gradients}
    if ds.zero_stage >= 1:
        zero["reduce_bucket_size"] = ds.reduce_bucket_size
    if ds.zero_stage == 3:
        zero |= {
            "sub_group_size": ds.sub_group_size,
            "stage3_prefetch_bucket_size": ds.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": ds.stage3_param_persistence_threshold,
            "stage3_max_live_parameters": ds.stage3_max_live_parameters,
            "stage3_max_reuse_distance": ds.stage3_max_reuse_distance,
            "stage3_gather_16bit_weights_on_model_save": ds.zero3_save_16bit_model,
        }
    cfg: dict = {
        "train_micro_batch_size_per_gpu": recipe.per_device_train_batch_size,
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
        "gradient_clipping": recipe.max_grad_norm or 0.0,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
    }
    if precision == "fp16":  # dynamic loss scaling, DeepSpeed's defaults written out
        cfg["fp16"] |= {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                        "hysteresis": 2, "min_loss_scale": 1}
    cfg["zero_optimization"] = zero
    cfg["steps_per_print"] = 2**31 - 1  # memrecipe's loop logs; keep DeepSpeed's own step log quiet
    cfg["wall_clock_breakdown"] = False
    return cfg


def parallelism_section(data_parallel: int, **sizes) -> dict:
    """accelerate's parallelism_config: one data-parallel group of `data_parallel` shards, no replicas, and the
    split's own keys."""
    keys = {"dp_replicate_size": 1, "dp_shard_size": data_parallel, **sizes}
    return {f"parallelism_config_{key}": value for key, value in keys.items()}


def accelerate_config(recipe: Recipe, topo: Topology, deepspeed_config_file: str | None = None) -> dict:
    """The accelerate YAML as a dict (key order as written)."""
    n = topo.num_processes
    dtype = recipe.distributed_type
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO" if dtype in ("no", "ddp") and n == 1 else DISTRIBUTED_TYPE[dtype],
        "num_processes": n,
        "num_machines": topo.num_machines,
        "machine_rank": topo.machine_rank,
    }
    if topo.num_machines > 1:
        cfg |= {"main_process_ip": topo.main_process_ip, "main_process_port": topo.main_process_port,
                "rdzv_backend": "c10d", "same_network": False}
    elif topo.main_process_port is not None:
        cfg["main_process_port"] = topo.main_process_port
    if recipe.deepspeed is None:  # with DeepSpeed, precision lives in the JSON only
        cfg["mixed_precision"] = resolve_precision(recipe, topo)
    # DeepSpeed finds the CPU itself; accelerate's use_cpu would switch DeepSpeed off.
    cfg["use_cpu"] = topo.cpu and recipe.deepspeed is None
    if recipe.fsdp is not None:
        cfg["fsdp_config"] = _fsdp_section(recipe, topo)
    # (accelerate's launcher exports the section as PARALLELISM_CONFIG_*; the Accelerator reads it)
    tp, sp, cp = recipe.tensor_parallel, recipe.sequence_group(n), recipe.context_parallel
    if tp > 1:
        cfg["parallelism_config"] = parallelism_section(n // tp, tp_size=tp, cp_size=1)
    if sp > 1:
        cfg["parallelism_config"] = parallelism_section(
            n // sp, sp_size=sp, sp_backend="deepspeed", sp_seq_length_is_variable=True,
            sp_attn_implementation=sp_attention(recipe))
    if cp > 1:  # ring attention: FSDP2 shards over every process (accelerate's "dp_shard_cp" dimension)
        cfg["parallelism_config"] = parallelism_section(n // cp, tp_size=1, cp_size=cp, cp_backend="torch",
                                                        cp_comm_strategy="allgather")
    if recipe.deepspeed is not None:
        section: dict[str, object] = {"deepspeed_config_file": deepspeed_config_file or f"{config_name(recipe, topo)}.json"}
        if recipe.deepspeed.zero_stage == 3:
            section["zero3_init_flag"] = recipe.deepspeed.zero3_init
        if topo.num_machines > 1:
            section["deepspeed_multinode_launcher"] = "standard"
        cfg["deepspeed_config"] = section
    return cfg


def _fsdp_section(recipe: Recipe, topo: Topology) -> dict:
    f = recipe.fsdp
    # Rank 0 loads the weights, the other ranks build the model without them, and FSDP2 broadcasts rank 0's
    # as shards (accelerate's fsdp2_load_full_state_dict; loading.load_pretrained builds the empty ones). On CPU,
    # FSDP1 asks for a GPU to sync module states, so there each rank loads the weights itself.
    efficient_loading = f.cpu_ram_efficient_loading and not (topo.cpu and f.version == 1)
    section: dict = {"fsdp_version": f.version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if f.transformer_layer_cls_to_wrap:
        section["fsdp_transformer_layer_cls_to_wrap"] = f.transformer_layer_cls_to_wrap
    if f.version == 2:
        section["fsdp_reshard_after_forward"] = f.reshard_after_forward
    else:
        section |= {"fsdp_sharding_strategy": "FULL_SHARD" if f.reshard_after_forward else "SHARD_GRAD_OP",
                    "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_use_orig_params": f.use_orig_params}
    section |= {
        "fsdp_offload_params": f.offload_params,
        "fsdp_state_dict_type": f.state_dict_type,
        "fsdp_cpu_ram_efficient_loading": efficient_loading,
        "fsdp_sync_module_states": efficient_loading,  # (accelerate launch asks for it beside efficient loading)
        "fsdp_activation_checkpointing": f.activation_checkpointing,
    }
    return section


def launch_env(recipe: Recipe, topo: Topology) -> dict[str, str]:
    """What `accelerate launch` of these configs needs in its environment: on CPU, several gloo processes of a
    config that is not DeepSpeed's need ACCELERATE_USE_CPU (accelerate starts one process for MULTI_CPU; the
    GPU types with the flag start N on gloo; DeepSpeed picks its CPU accelerator itself)."""
    return {"ACCELERATE_USE_CPU": "true"} if topo.cpu and topo.num_processes > 1 and recipe.deepspeed is None else {}


def launch_words(config_file: str, script: str, recipe_file: str, machines: int = 1, machine_rank: int | str = 0,
                 options=(), script_args=()) -> list[str]:
    """The words after `accelerate launch`: the config, launch options, the loop and its recipe. On several
    machines, torch's c10d rendezvous (launch reads rdzv_backend from its command line only, not from the
    YAML) with machine 0 said to host its store rather than guessed from host names (which all match on
    one box); `machine_rank` may be a shell expression that says true or false (the sbatch script's)."""
    words = ["--config_file", config_file, *options]
    if machines > 1:
        host = str(machine_rank == 0).lower() if isinstance(machine_rank, int) else machine_rank
        words += ["--rdzv_backend", "c10d", "--rdzv_conf", f"is_host={host}"]
    return [*words, script, "--recipe", recipe_file, *script_args]


@dataclass(frozen=True)
class Invocation:
    """How the generated files are run: what `accelerate launch` needs, from the folder it runs in."""

    config_file: str
    script: str = "recipes/sft.py"
    recipe_file: str = "recipes/RECIPE.yaml"
    env: tuple[tuple[str, str], ...] = ()
    machines: int = 1
    machine_rank: int = 0

    @classmethod
    def of(cls, recipe: Recipe, topo: Topology, config_file: str, script: str, recipe_file: str) -> Invocation:
        return cls(config_file, script, recipe_file, tuple(launch_env(recipe, topo).items()), topo.num_machines,
                   topo.machine_rank)

    def argv(self) -> list[str]:
        return ["accelerate", "launch", *launch_words(self.config_file, self.script, self.recipe_file, self.machines,
                                                      self.machine_rank)]

    def shell(self) -> str:
        return "".join(f"{k}={v} " for k, v in self.env) + shlex.join(self.argv())


def render_yaml(cfg: dict, header: list[str]) -> str:
    """YAML text with the header lines as comments, and each key's reason beside it."""
    lines = yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False).splitlines()
    width = max(len(line) for line in lines) + 2
    out = [f"# {h}" if h else "#" for h in header]
    for line in lines:
        key = line.strip().split(":", 1)[0]
        why = WHY.get(key)
        out.append(f"{line.ljust(width)}# {why}" if why and not line.rstrip().endswith(":") else line)
    return "\n".join(out) + "\n"


def render_json(cfg: dict, comment: str) -> str:
    # JSON has no comments: DeepSpeed ignores unknown top-level keys, so the command rides in one.
    return json.dumps({"_comment": comment, **cfg}, indent=2) + "\n"


def generate(recipe: Recipe, topo: Topology, folder: str = "", recipe_ref: str | None = None,
             overrides=(), script: str = "recipes/sft.py", recipe_file: str | None = None) -> dict[str, str]:
    """File name -> text for this recipe on this topology, referring to each other inside `folder`.

    `recipe_ref` is how the user named the recipe (a name, or a path to a YAML file); the headers
    carry the `memrecipe config` command that writes these files again, and the launch command.
    """
    recipe_ref = recipe_ref or recipe.name
    regenerate = regenerate_command(recipe_ref, topo, folder, overrides)
    if recipe_file is None:
        recipe_file = f"recipes/{recipe.name}.yaml" if recipe_ref == recipe.name else recipe_ref
    stem = config_name(recipe, topo)
    prefix = f"{folder.rstrip('/')}/" if folder not in ("", ".") else ""
    ds = deepspeed_config(recipe, topo)
    ds_name = f"{stem}.json"
    run = Invocation.of(recipe, topo, f"{prefix}{stem}.yaml", script, recipe_file)
    header = [
        f"memrecipe recipe {recipe.name} on {topo.describe()}.",
        f"Regenerate: {regenerate}",
        f"Run:        {run.shell()}",
    ]
    if ds is not None:
        header.append(f"Batch, accumulation, precision, clipping and ZeRO settings are in {prefix}{ds_name}.")
        if topo.cpu:
            header.append("On CPU DeepSpeed picks its CPU accelerator itself (gloo); use_cpu stays false.")
    if not topo.cpu and recipe.mixed_precision == "auto" and topo.bf16 is None:
        header.append("mixed_precision auto was resolved to bf16 (Ampere or newer); on V100/T4 add mixed_precision=fp16.")
    files = {f"{stem}.yaml": render_yaml(accelerate_config(recipe, topo, f"{prefix}{ds_name}" if ds else None), header)}
    if ds is not None:
        files[ds_name] = render_json(ds, f"memrecipe {recipe.name} on {topo.describe()}. Regenerate: {regenerate}")
    return files


def default_topologies(recipe: Recipe) -> list[Topology]:
    """The topologies shipped in accelerate_configs/: 1 GPU, 8 GPUs, and the CPU smoke-test form."""
    s = recipe.supports
    fits = lambda n: s.min_processes <= n and (s.max_processes is None or n <= s.max_processes)  # noqa: E731
    out = [Topology(num_processes=n) for n in (1, 8) if fits(n)]
    if recipe.cpu_blocker is None:
        out.append(Topology(num_processes=2 if fits(2) else 1, cpu=True))
    return out


def regenerate_command(recipe_name: str, topo: Topology, folder: str, overrides=()) -> str:
    """The `memrecipe config` command that writes these files."""
    words = ["memrecipe", "config", recipe_name, "--num-processes", str(topo.num_processes)]
    if topo.cpu:
        words.append("--cpu")
    if topo.num_machines > 1:
        words += ["--num-machines", str(topo.num_machines), "--machine-rank", str(topo.machine_rank),
                  "--main-process-ip", topo.main_process_ip, "--main-process-port", str(topo.main_process_port)]
    elif topo.main_process_port is not None:
        words += ["--main-process-port", str(topo.main_process_port)]
    if folder:
        words += ["--output-dir", folder]
    return shlex.join(words + list(overrides))


def shipped_files(recipe: Recipe, folder: str = "accelerate_configs", **kwargs) -> dict[str, str]:
    """The configs for a recipe's default topologies: what accelerate_configs/ holds."""
    files: dict[str, str] = {}
    for topo in default_topologies(recipe):
        files |= generate(recipe, topo, folder=folder, **kwargs)
    return files


def script_files(recipe_ref: str, recipe: Recipe, recipe_file: str) -> dict[str, str]:
    """The loops (sft.py, dpo.py) and the recipe, to sit side by side in a folder of their own (`cp`, `slurm`): the recipe
    file as written, with its header's repo paths made local; a recipe with a `base:` resolved, since its
    base would not be found from there."""
    from .registry import data_dir, read_yaml, recipe_path

    path = recipe_path(recipe_ref)
    if "base" in read_yaml(path):
        text = f"# {recipe.name}: {path} resolved (its base: included)\n{recipe.to_yaml()}"
    else:
        text = path.read_text(encoding="utf-8")
        for old, new in ((f"recipes/{recipe.name}.yaml", recipe_file), ("recipes/sft.py", "sft.py"),
                         ("accelerate_configs/", "")):
            text = text.replace(old, new)
    # both loops: dpo.py takes sft.py's setup steps and loop from beside it
    loops = {name: (data_dir("recipes") / name).read_text(encoding="utf-8") for name in ("sft.py", "dpo.py")}
    return {**loops, recipe_file: text}
