"""planning/configs.py: accelerate's and DeepSpeed's own loaders accept every config it writes."""

import json
import subprocess
import sys
import textwrap

import yaml

from memrecipe.planning.configs import accelerate_config, deepspeed_config, generate, shipped_files
from memrecipe.planning.registry import data_dir, load_recipe, recipe_names
from memrecipe.planning.topology import Topology, make_topology, resolve_precision

TOPOLOGIES = [
    Topology(1), Topology(8), Topology(2, cpu=True), Topology(1, cpu=True),
    make_topology(16, 2, 1, "10.0.0.1", 29500),
]


def all_generated(tmp_path):
    """(recipe, topology, folder) for every recipe on every topology it supports, written to disk."""
    out = []
    for name in recipe_names():
        r = load_recipe(name)
        for topo in TOPOLOGIES:
            s = r.supports
            if topo.num_processes < s.min_processes or (s.max_processes and topo.num_processes > s.max_processes):
                continue
            if topo.num_machines > 1 and not s.multi_node:
                continue
            folder = tmp_path / f"{name}-{topo.name}"
            folder.mkdir()
            for fname, text in generate(r, topo, str(folder)).items():
                (folder / fname).write_text(text)
            out.append((r, topo, folder))
    return out


def test_accelerate_launch_accepts_every_generated_config(tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parser = launch_command_parser()
    options = {a.dest for a in parser._actions}
    generated = all_generated(tmp_path)
    assert len(generated) >= 14
    for r, topo, folder in generated:
        (path,) = folder.glob("*.yaml")
        args, defaults, _ = _validate_launch_command(parser.parse_args(["--config_file", str(path), "sft.py"]))
        assert defaults.num_processes == topo.num_processes and defaults.num_machines == topo.num_machines
        assert args.num_processes == topo.num_processes
        if topo.num_processes > 1 or r.deepspeed:  # the launcher that really starts N processes
            assert args.multi_gpu or args.use_fsdp or args.use_deepspeed, path
        assert args.use_fsdp == (r.fsdp is not None) and args.use_deepspeed == (r.deepspeed is not None)
        # nested keys are copied onto launch options: each must be a real one, or accelerate drops it
        for key in defaults.fsdp_config:
            assert key in options, f"{path}: fsdp_config.{key} is not an accelerate launch option"
        for key in defaults.deepspeed_config:
            assert key in options, f"{path}: deepspeed_config.{key} is not an accelerate launch option"
        for key in defaults.parallelism_config:
            assert key in options, f"{path}: parallelism_config.{key} is not an accelerate launch option"


def test_fsdp_config_reads_back_as_the_recipe_says(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    r = load_recipe("fsdp")
    path = tmp_path / "f.yaml"
    path.write_text(generate(r, Topology(8))["fsdp_8gpu.yaml"])
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value == "FSDP" and cfg.mixed_precision == "bf16"
    f = cfg.fsdp_config
    assert f["fsdp_version"] == 2 and f["fsdp_reshard_after_forward"] is True
    assert f["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in f  # accelerate then wraps the model's _no_split_modules
    assert f["fsdp_activation_checkpointing"] is True and f["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert f["fsdp_cpu_ram_efficient_loading"] and f["fsdp_sync_module_states"]


def test_deepspeed_plugin_and_zero_model_accept_the_json(tmp_path):
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for r, _, folder in all_generated(tmp_path):
        if r.deepspeed is None:
            continue
        (js,) = folder.glob("*.json")
        cfg = json.loads(js.read_text())
        zero = DeepSpeedZeroConfig(**cfg["zero_optimization"])  # extra="forbid": a wrong key fails here
        ds = r.deepspeed
        assert zero.stage == ds.zero_stage and zero.offload_optimizer.device == ds.offload_optimizer
        assert (zero.offload_param.device if zero.offload_param else "none") == ds.offload_param
        assert zero.offload_optimizer.pin_memory == ds.pin_memory
        if ds.zero_stage == 3:
            assert zero.gather_16bit_weights_on_model_save == ds.zero3_save_16bit_model
        plugin = DeepSpeedPlugin(hf_ds_config=str(js), zero3_init_flag=ds.zero_stage == 3)
        assert plugin.zero_stage == ds.zero_stage
        assert plugin.gradient_accumulation_steps == r.gradient_accumulation_steps
        text = js.read_text()
        assert '"auto"' not in text and "train_batch_size\"" not in text


def test_deepspeed_config_is_accepted_whole_by_deepspeed(tmp_path):
    """DeepSpeedConfig needs a process group; one gloo rank in a child process stands in for it."""
    paths = [str(f) for _, _, folder in all_generated(tmp_path) for f in folder.glob("*.json")]
    code = textwrap.dedent(f"""
        import json, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29611", rank=0, world_size=1)
        from deepspeed.runtime.config import DeepSpeedConfig
        for p in {paths!r}:
            c = DeepSpeedConfig(json.load(open(p)))
            raw = json.load(open(p))
            assert c.train_micro_batch_size_per_gpu == raw["train_micro_batch_size_per_gpu"]
            assert c.gradient_accumulation_steps == raw["gradient_accumulation_steps"]
            assert c.gradient_clipping == raw["gradient_clipping"]
            assert c.bfloat16_config.enabled == raw["bf16"]["enabled"]
            assert c.zero_config.stage == raw["zero_optimization"]["stage"]
        print("checked", len({paths!r}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"checked {len(paths)}" in done.stdout


def test_batch_precision_and_clipping_are_written_once():
    for name in recipe_names():
        r = load_recipe(name)
        for topo in (Topology(8) if r.supports.max_processes != 1 else Topology(1), Topology(1, cpu=True)):
            acc = accelerate_config(r, topo)
            ds = deepspeed_config(r, topo)
            flat = yaml.safe_dump(acc)
            if ds is not None:  # DeepSpeed: in the JSON only (accelerate refuses them twice)
                assert "mixed_precision" not in flat and "gradient_accumulation_steps" not in flat
                assert "gradient_clipping" not in flat
                assert ds["train_micro_batch_size_per_gpu"] == r.per_device_train_batch_size
                assert ds["gradient_accumulation_steps"] == r.gradient_accumulation_steps
                assert ds["gradient_clipping"] == r.max_grad_norm
                assert ds["bf16"]["enabled"] is (resolve_precision(r, topo) == "bf16")
            else:  # the loop passes accumulation and clipping to the Accelerator from the recipe
                assert acc["mixed_precision"] == resolve_precision(r, topo)
                assert "gradient_accumulation_steps" not in flat


def test_multi_node_configs_carry_the_rendezvous():
    topo = make_topology(16, 2, 1, "10.0.0.1", 29501)
    acc = accelerate_config(load_recipe("zero3-offload"), topo)
    assert (acc["machine_rank"], acc["num_machines"], acc["num_processes"]) == (1, 2, 16)
    assert acc["main_process_ip"] == "10.0.0.1" and acc["main_process_port"] == 29501
    assert acc["rdzv_backend"] == "c10d" and acc["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    # with c10d, same_network true would send every machine to its own localhost:29400
    assert acc["same_network"] is False
    (text,) = generate(load_recipe("fsdp"), topo).values()
    assert generate(load_recipe("fsdp"), topo).keys() == {"fsdp_2x8gpu_rank1.yaml"}
    # accelerate launch reads rdzv_backend from its command line only: the Run line passes it
    assert "accelerate launch --config_file fsdp_2x8gpu_rank1.yaml --rdzv_backend c10d" in text


def test_shipped_configs_equal_the_generator_output():
    """accelerate_configs/ never drifts: regenerate with the command in each file's header."""
    folder = data_dir("accelerate_configs")
    expected = {}
    for name in recipe_names():
        expected |= shipped_files(load_recipe(name))
    on_disk = {p.name: p.read_text() for p in folder.iterdir() if p.suffix in (".yaml", ".json")}
    assert sorted(on_disk) == sorted(expected)
    for fname, text in expected.items():
        assert on_disk[fname] == text, f"accelerate_configs/{fname} differs from the generator: regenerate it"
    assert {"zero3_offload_8gpu.yaml", "zero3_offload_8gpu.json", "fsdp_cpu2.yaml", "single_gpu_lora_1gpu.yaml",
            "single_gpu_lora_cpu1.yaml", "adamw_8bit_cpu2.yaml", "zero3_offload_1gpu.yaml"} <= set(on_disk)


def test_each_shipped_file_is_headed_by_the_command_that_regenerates_it(tmp_path, cli):
    folder = data_dir("accelerate_configs")
    for path in sorted(folder.glob("*.yaml")):
        header = path.read_text().splitlines()[1]
        assert header.startswith("# Regenerate: memrecipe config "), path
        words = header.removeprefix("# Regenerate: memrecipe ").split()
        out = tmp_path / path.stem
        words[words.index("--output-dir") + 1] = str(out)
        done = cli(*words)
        assert done.returncode == 0, done.stderr
        assert (out / path.name).is_file()


def test_recipe_headers_hold_the_exact_launch_commands_of_their_configs():
    """Each recipe YAML opens with the commands that run it: they must be the configs' own Run lines."""
    from memrecipe.planning.registry import recipe_path

    folder = data_dir("accelerate_configs")
    for name in recipe_names():
        header = recipe_path(name).read_text().split("\nname:")[0]
        assert f"memrecipe run sft --recipe {name}" in header
        stems = [f.removesuffix(".yaml") for f in shipped_files(load_recipe(name)) if f.endswith(".yaml")]
        for stem in stems:
            run_line = next(line for line in (folder / f"{stem}.yaml").read_text().splitlines()
                            if line.startswith("# Run:"))
            command = run_line.removeprefix("# Run:").strip()
            assert command in header, f"{name}: header lacks `{command}`"


def test_config_with_overrides_writes_the_resolved_recipe_its_run_line_trains(cli, tmp_path):
    """The JSON says micro batch 2: the Run line must not train the shipped recipe's 4 under it."""
    import re
    import shlex

    done = cli("config", "zero3-offload", "--cpu", "--num-processes", "2", "per_device_train_batch_size=2",
               "--output-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    run = re.search(r"^# Run: +(.*)$", (tmp_path / "zero3_offload_cpu2.yaml").read_text(), re.M).group(1)
    words = shlex.split(run)
    recipe = load_recipe(words[words.index("--recipe") + 1])
    assert recipe.per_device_train_batch_size == 2 == json.loads(
        (tmp_path / "zero3_offload_cpu2.json").read_text())["train_micro_batch_size_per_gpu"]
