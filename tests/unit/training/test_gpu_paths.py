"""GPU-only paths, checked where a CPU can check them: what the code decides from the GPU it is
told about (stubbed), the launch it would build, the files it would write. docs/gpu.md lists the
first command to run on a real GPU box for each."""

from types import SimpleNamespace

import pytest
import torch

from conftest import run_cli
from helpers import loop_model
from model_configs import model_folder
from memrecipe.planning.hardware import Machine
from memrecipe.training import device
from memrecipe.training.device import detect_machine
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import make_topology, resolve_precision


@pytest.fixture
def volta(monkeypatch):
    """torch sees one GPU of compute capability 7.0 (V100), on which bf16 only runs emulated."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=0: SimpleNamespace(major=7, minor=0, total_memory=16 * 2**30))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
    monkeypatch.setattr(torch.version, "hip", None)


def test_auto_precision_is_fp16_on_a_v100_although_torch_can_emulate_bf16(volta):
    assert torch.cuda.is_bf16_supported()  # what torch says by default: emulated bf16 counts
    machine = detect_machine()
    assert machine.gpus == 1 and machine.bf16 is False
    topo = make_topology(1, bf16=machine.bf16)
    assert resolve_precision(load_recipe("single-gpu-lora"), topo) == "fp16"


def test_a_gpu_deepspeed_launch_gives_each_rank_its_share_of_the_cores(monkeypatch, tmp_path):
    """torchrun sets 1 thread per process on a node with several; the launch says how many instead
    (what --dry-run prints is what `run` would execute)."""
    from click.testing import CliRunner

    from memrecipe.main import cli

    node = Machine(gpus=8, gpu_memory=80 * 2**30, bf16=True, cores=96, host_memory=1024 * 2**30)
    monkeypatch.setattr(device, "detect_machine", lambda: node)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    words = ["run", "sft", "--num-processes", "8", "--dry-run", "--output-dir", str(tmp_path / "r")]
    done = CliRunner().invoke(cli, [*words, "--recipe", "zero3-offload"])
    assert done.exit_code == 0, done.output
    command = next(line for line in done.output.splitlines() if "accelerate" in line and "launch" in line)
    assert "OMP_NUM_THREADS=12" in command
    fsdp = CliRunner().invoke(cli, [*words, "--recipe", "fsdp"])
    assert fsdp.exit_code == 0 and "OMP_NUM_THREADS" not in fsdp.output  # FSDP computes on the GPUs only


def test_fsdp_qlora_quantizes_on_the_host_and_fsdp_moves_each_quant_state_with_its_weight(monkeypatch):
    """On a GPU box, with no device_map the bitsandbytes quantizer loads the whole 4-bit model onto every
    rank's GPU. Under FSDP the loop asks for the host; FSDP's own move to its device then carries each
    weight's quant_state: FSDP1 moves with `param.data = param.to(device_id)`, and the `param.to` half
    moves the quant_state the parameter shares (checked to the meta device: no GPU here, and meta data
    cannot be set into a CPU tensor, the assignment half)."""
    from transformers import AutoModelForCausalLM

    from memrecipe.training.loading import embedded_model

    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    recipe = load_recipe("fsdp-qlora")
    model, _ = loop_model(recipe, embedded_model(), "bf16", device=torch.device("cuda", 0))
    assert seen["device_map"] == {"": "cpu"}
    quantized = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    assert quantized and all(p.quant_state.absmax.device.type == "cpu" for p in quantized)
    for p in quantized:
        moved = p.to(torch.device("meta"))
        state = p.quant_state  # the original parameter's: the one the layer's forward reads
        tensors = [state.absmax, state.code] + ([state.state2.absmax, state.state2.code] if state.nested else [])
        assert moved.device.type == "meta" and all(t.device.type == "meta" for t in tensors)
    seen.clear()
    loop_model(load_recipe("qlora"), embedded_model(), "bf16", device=torch.device("cpu"))
    assert "device_map" not in seen  # one process without FSDP: quantized where it runs


LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def test_fsdp_counts_the_copies_of_the_model_its_ranks_load(monkeypatch, tmp_path, capsys):
    """FSDP2 full fine-tuning with cpu_ram_efficient_loading (the recipe's): rank 0 alone loads the whole fp32 model,
    the others build it without weights and receive shards: a 70B needs ~263 GiB of host RAM at load (`plan --json`'s
    host_total for micro batch 1 x 4096 on 8 x 80 GB <= 700 GiB). Without it each of a node's 8 ranks loads (and
    accelerate upcasts) its own copy, ~2.1 TB; `run` says so before launching."""
    import json

    from memrecipe.planning.architecture import structure
    from memrecipe.main import main
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.topology import Topology

    s = structure(LLAMA_70B)
    assert estimate(load_recipe("fsdp"), s, Topology(8)).host_load == 4 * s.params
    every = ["fsdp.cpu_ram_efficient_loading=false"]
    full = estimate(load_recipe("fsdp", every), s, Topology(8))
    assert full.host_load == 4 * s.params * 8 and full.host_total() / 2**40 > 2
    assert estimate(load_recipe("fsdp", every), s, Topology(16, 2)).host_load == full.host_load  # per machine
    lora = estimate(load_recipe("fsdp-lora"), s, Topology(8))
    assert lora.host_load == 2 * s.params  # the bf16 base, mapped once per machine
    assert estimate(load_recipe("zero3-offload"), s, Topology(8)).host_load == 0  # built partitioned
    folder = model_folder(tmp_path / "llama-70b", LLAMA_70B)
    planned = json.loads(run_cli("plan", "--model", str(folder), "--recipe", "fsdp", "--num-processes", "8",
                                 "--gpu-memory", "80GB", "--json", "per_device_train_batch_size=1",
                                 "max_seq_length=4096").stdout)
    assert planned["estimates"][0]["host_total"] <= 700 * 2**30
    node = Machine(gpus=8, gpu_memory=80 * 2**30, bf16=True, cores=96, host_memory=512 * 2**30)
    monkeypatch.setattr(device, "detect_machine", lambda: node)
    with pytest.raises(SystemExit) as done:
        main(["run", "sft", "--recipe", "fsdp", "--model", str(folder), "--dry-run", "--output-dir", str(tmp_path / "r"),
              *every])
    said = capsys.readouterr().err  # a dry run shows the launch, and what a run would be refused for
    assert done.value.code == 0 and "a run on this machine would be refused: recipe fsdp will not fit" in said
    assert "loading: every process's copy of the model" in said and "> 512.0 GiB" in said
    assert not (tmp_path / "r").exists()


def test_zero3s_partitioned_parameters_keep_weight_decay_for_the_matrices():
    """ZeRO-3 built partitioned (zero.Init: zero3-offload, zero3-ulysses) leaves every parameter an empty 1-D tensor,
    its shape in `ds_shape`: the matrices keep the recipe's weight decay and the norms none (read off the 1-D
    tensors, every weight went undecayed: `weight_decay=0.1` did nothing under ZeRO-3). The model is built as the
    loop builds it, under DeepSpeed's zero.Init on one gloo process (a child: the process group stays there)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        os.environ["LOCAL_RANK"] = "0"  # (as a launcher sets it)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29613", rank=0, world_size=1)
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig
        from memrecipe.planning.registry import load_recipe
        from memrecipe.training.loading import embedded_model
        from memrecipe.training.optimizers import param_groups
        zero3 = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
        model = AutoModelForCausalLM.from_pretrained(embedded_model())  # under zero.Init, as accelerate loads it
        assert all(p.ndim == 1 and p.numel() == 0 for p in model.parameters())  # partitioned: empty 1-D tensors
        decay = {n: g["weight_decay"] for g in param_groups(load_recipe("zero3-offload", ["weight_decay=0.1"]), model)
                 for n, p in model.named_parameters() if any(p is q for q in g["params"])}
        matrices = {n for n, p in model.named_parameters() if len(p.ds_shape) == 2}
        assert matrices and {n for n, d in decay.items() if d == 0.1} == matrices, decay
        assert {d for n, d in decay.items() if n not in matrices} == {0.0} and len(decay) == len(list(model.parameters()))
        print("decayed", len(matrices), "of", len(decay))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decayed 30 of 39" in done.stdout  # 4 layers x 7 linears, the embedding and the head


def test_fsdp1_flat_parameters_keep_weight_decay_for_the_matrices_they_flatten():
    """FSDP1 (fsdp-qlora) hands the optimizer 1-D flat parameters; torch's FlatParameter keeps the
    original shapes in `_shapes` (torch/distributed/fsdp/_flat_param.py): adapters' units are all
    matrices and keep their weight decay, a unit of norms does not."""
    from memrecipe.training.optimizers import make_optimizer

    adapters = torch.nn.Parameter(torch.zeros(2 * 8 * 16))
    adapters._shapes = (torch.Size([8, 16]), torch.Size([16, 8]))  # lora_A, lora_B flattened
    norms = torch.nn.Parameter(torch.zeros(32))
    norms._shapes = (torch.Size([16]), torch.Size([16]))
    model = torch.nn.Module()
    model.adapters, model.norms = adapters, norms
    optimizer = make_optimizer(load_recipe("fsdp-qlora", ["weight_decay=0.1"]), model,
                               SimpleNamespace(device=torch.device("cpu")))
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decay == {id(adapters): 0.1, id(norms): 0.0}
