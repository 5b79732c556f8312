"""Host memory as ZeRO-3's offload pins it (planning/states.py): the tensors DeepSpeed asks its accelerator to pin,
recorded from a real engine on CPU, are the plan's to the byte; the sub groups are DeepSpeed's own; each pinned
request takes torch's power-of-two block on a GPU box (which a CPU cannot show: torch pins nothing there)."""

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.states import (flat_shard, fsdp1_host_tensors, fsdp2_shard, host_block, pinned_bytes, sub_groups,
                                       zero2_host_tensors, zero3_host_tensors)
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.states import trainable_tensors
from memrecipe.training.loading import embedded_model


def test_a_pinned_request_takes_the_next_power_of_two_up_to_the_cache_limit_memrecipe_sets():
    """torch's CachingHostAllocator rounds a pinned block up to a power of two and caches it when freed, below
    pinned_max_cached_size_mb (memrecipe/__init__.py sets 64); above it a block is its request, released when freed."""
    assert [host_block(n) for n in (1, 2, 3, 4096, 4097, 40 * 2**20)] == [1, 2, 4, 4096, 8192, 64 * 2**20]
    assert host_block(64 * 2**20 + 1) == 64 * 2**20 + 1 and host_block(4_740_000_000) == 4_740_000_000
    assert pinned_bytes([3, 100 * 2**20], [5, 200 * 2**20]) == 4 + 100 * 2**20 + 8  # the large freed one released


def test_sub_groups_are_deepspeeds_own():
    """stage3.py's _create_fp16_sub_groups, called on parameters of these partition sizes."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    partitions = [525_336_576, 16_777_216, 4_194_304, 4_194_304, 16_777_216, 58_720_256, 58_720_256, 58_720_256] * 3
    for size in (100_000_000, 1_000_000_000, 10**12):
        params = [SimpleNamespace(partition_numel=lambda n=n: n) for n in partitions]
        theirs = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(SimpleNamespace(sub_group_size=size), params)
        assert sub_groups(partitions, size) == [sum(p.partition_numel() for p in g) for g in theirs]


ENGINE = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29614", rank=0, world_size=1)
    import deepspeed
    import deepspeed.accelerator.cpu_accelerator as cpu
    from types import SimpleNamespace
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from memrecipe.planning.configs import deepspeed_config
    from memrecipe.planning.registry import load_recipe
    from memrecipe.planning.topology import Topology
    from memrecipe.training.adapters import add_lora
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.optimizers import make_optimizer
    words = [w for w in sys.argv[2:] if w != "--copy"]
    recipe = load_recipe(sys.argv[1], words)
    config = deepspeed_config(recipe, Topology(1, cpu=True))
    pinned, pin = [], cpu.CPU_Accelerator.pin_memory
    cpu.CPU_Accelerator.pin_memory = lambda self, t, *a, **k: pinned.append(t.numel() * t.element_size()) or pin(self, t, *a, **k)
    keep = HfDeepSpeedConfig(config)
    model = AutoModelForCausalLM.from_pretrained(embedded_model(), dtype=torch.bfloat16)  # under zero.Init
    if recipe.lora:
        engine = SimpleNamespace(native_amp=False, mixed_precision="bf16", distributed_type=SimpleNamespace(value="DEEPSPEED"))
        model = add_lora(model, recipe.lora, accelerator=engine)
    optimizer = make_optimizer(recipe, model, SimpleNamespace(device=torch.device("cpu")))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if recipe.deepspeed.zero_stage < 3:  # (ZeRO-1/2 pins its accumulation buffers at the first backward)
        ids = torch.randint(4, 100, (2, 16))
        for _ in range(recipe.gradient_accumulation_steps):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    print("PINNED", json.dumps(sorted(pinned)))
    if "--copy" in sys.argv:  # DPO's frozen copy, as training/reference.py makes it: loaded partitioned, no optimizer
        pinned.clear()
        copy = AutoModelForCausalLM.from_pretrained(embedded_model(), dtype=torch.bfloat16).requires_grad_(False)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        deepspeed.initialize(model=copy, config=config)
        print("COPY", json.dumps(sorted(pinned)))
""")


@pytest.mark.parametrize("words", [[], ["lora.r=8", "lora.target_modules=all-linear"]], ids=["full", "lora"])
def test_the_tensors_zero3s_offload_pins_are_the_plans(words):
    """A ZeRO-3 engine with parameters and optimizer offloaded, built as the loop builds it (zero.Init, the loop's
    optimizer groups, DeepSpeed's CPU Adam) on one gloo process: every tensor its accelerator is asked to pin (each
    parameter's partition, the flat 16-bit buffers, the flat gradients, the fp32 gradient per sub group), recorded,
    is a tensor planning.states lists, of the same bytes."""
    done = subprocess.run([sys.executable, "-c", ENGINE, "zero3-offload", *words], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = next(line for line in done.stdout.splitlines() if line.startswith("PINNED"))
    recipe, s = load_recipe("zero3-offload", words), structure(read_config(embedded_model()))
    planned = zero3_host_tensors(recipe, s, trainable_tensors(recipe, s), 1, 2)
    assert recorded == "PINNED " + str(sorted(planned["params"] + planned["freed"] + planned["grads"]))


def test_dpos_offloaded_reference_copy_pins_each_partition_as_planned():
    """DPO's frozen copy of the model under zero3-offload (training/reference.py: loaded under zero.Init, an engine of
    its own without an optimizer) pins every parameter's partition and nothing else, recorded from a real engine on
    CPU: the tensors states.add_reference plans, and on a GPU box the plan's host and pinned figures hold them as
    torch's host allocator does (each below 64 MB rounded to a power of two)."""
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.topology import Topology

    done = subprocess.run([sys.executable, "-c", ENGINE, "zero3-offload", "--copy"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("COPY")).split(" ", 1)[1])
    s = structure(read_config(embedded_model()))
    assert recorded == sorted(2 * t.numel for t in s.tensors())
    words = ["dpo.precompute_ref_log_probs=false"]
    policy, both = (estimate(load_recipe("zero3-offload", w, script="dpo"), s, Topology(1)) for w in ([], words))
    assert both.host_pinned > policy.host_pinned > 0
    assert both.host_offload - policy.host_offload == both.host_pinned - policy.host_pinned == pinned_bytes(recorded, [])


def test_the_plans_pinned_host_memory_is_what_is_page_locked_of_its_host_figure():
    """Estimate.host_pinned (in `plan --json`; gpu_acceptance holds a run's pinned bytes to it): the activation
    offload's arena, all of its host figure; ZeRO-3's offload, all but CPU Adam's fp32 master and moments (12 bytes a
    trained parameter, pageable); 0 on CPU, where nothing is pinned."""
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.topology import Topology

    s = structure(read_config(embedded_model()))
    offload = estimate(load_recipe("single-gpu-lora", ["gradient_checkpointing=true", "activation_offload=true"]), s,
                       Topology(1))
    assert offload.host_pinned == offload.host_offload > 0
    zero3 = estimate(load_recipe("zero3-offload"), s, Topology(1))
    assert zero3.host_offload - zero3.host_pinned == 12 * s.params and zero3.host_pinned > 0
    assert estimate(load_recipe("zero3-offload", ["deepspeed.pin_memory=false"]), s, Topology(1)).host_pinned == 0
    assert estimate(load_recipe("zero3-offload"), s, Topology(1, cpu=True)).host_pinned == 0


@pytest.mark.parametrize("words", [[], ["lora.r=8", "lora.target_modules=all-linear", "gradient_accumulation_steps=1"]],
                         ids=["full", "lora"])
def test_the_tensors_zero2s_optimizer_offload_pins_are_the_plans(words):
    """A ZeRO-2 engine with its optimizer offloaded (the zero2 recipe), built as the loop builds it, through its
    first optimizer step on one gloo process: every tensor its accelerator is asked to pin (each group's fp32
    partition, its 16-bit buffer and fp32 gradient, the largest parameter's 16-bit buffer, and under gradient
    accumulation each parameter's 16-bit accumulator, which DeepSpeed's estimator leaves out) is one
    states.zero2_host_tensors lists, of the same bytes; the plan's host figure holds them and CPU Adam's moments (or
    loading's fp32 copy of the model, where more)."""
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.topology import Topology

    done = subprocess.run([sys.executable, "-c", ENGINE, "zero2", *words], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PINNED")).split(" ", 1)[1])
    recipe, s = load_recipe("zero2", words), structure(read_config(embedded_model()))
    planned, partitions = zero2_host_tensors(recipe, trainable_tensors(recipe, s), 1, 0, 2)
    assert recorded == sorted(planned)
    est = estimate(recipe, s, Topology(1))
    assert est.host_pinned == pinned_bytes(recorded, [])
    assert est.host_offload == max(est.host_pinned + 8 * partitions, 4 * s.params)  # (or the loading's fp32 copy)


FSDP2 = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from types import SimpleNamespace
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)  # (no peer needed)
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.adapters import add_lora
    from memrecipe.training.loading import embedded_model, load_pretrained
    recipe = load_recipe(sys.argv[1], ["fsdp.offload_params=true"])
    model = load_pretrained(recipe, embedded_model(), "bf16", own_weights=True)
    if recipe.lora:
        model = add_lora(model, recipe.lora)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, cpu_ram_efficient_loading=False,
                                            mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                  mixed_precision="bf16", device=torch.device("cpu"), is_main_process=True)
    pinned = []
    torch.Tensor.pin_memory = lambda t, *a, **k: pinned.append(t.numel() * t.element_size()) or t.clone()
    fsdp2_prepare_model(accelerator, model)  # (accelerate's own FSDP2 preparation)
    print("PINNED", json.dumps(sorted(pinned)))
""")


@pytest.mark.parametrize("recipe", ["fsdp", "fsdp-lora"])
def test_fsdp2s_offload_pins_each_shard_and_each_trained_shards_gradient(recipe):
    """FSDP2's parameter offload (accelerate's CPUOffloadPolicy, pin_memory on), prepared by accelerate's
    fsdp2_prepare_model over a fake three-process group on the CPU device (uneven shards, padded): torch pins each parameter's shard (dim 0
    padded to a multiple of the processes), trained ones in fp32, a LoRA's frozen base in bf16, recorded as
    states.fsdp_host_tensors lists them; beside them each trained shard's gradient, copied from the GPU to the host
    without blocking (_fsdp_collectives.py foreach_reduce: a pinned tensor; a CPU's gradients are on the host
    already, so that half is read off the source). Each a block of torch's host allocator; the optimizer's state
    pageable beside them."""
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.states import fsdp_host_tensors, optimizer_state_bytes
    from memrecipe.planning.topology import Topology

    done = subprocess.run([sys.executable, "-c", FSDP2, recipe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PINNED")).split(" ", 1)[1])
    s = structure(read_config(embedded_model()))
    r = load_recipe(recipe, ["fsdp.offload_params=true"])
    est, train = estimate(r, s, Topology(3)), trainable_tensors(r, s)
    grads = [4 * fsdp2_shard(t, 3) for t in train]
    assert sorted(fsdp_host_tensors(r, s, train, 3, 2)) == sorted(recorded + grads)
    assert est.host_pinned == 3 * pinned_bytes(recorded + grads, [])  # three processes on the machine
    assert est.host_offload - est.host_pinned == optimizer_state_bytes(r, train, 4)  # (a third a process, pageable)


FSDP1 = textwrap.dedent("""
    import functools, json, sys, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)  # (no peer needed)
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.adapters import add_lora
    from memrecipe.training.loading import embedded_model, load_pretrained
    recipe = load_recipe(sys.argv[1], sys.argv[2:])
    model = load_pretrained(recipe, embedded_model(), "bf16", own_weights=True)  # (a 4-bit base: quantized on the host)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    if recipe.lora:  # as training.accelerator.wrap_first wraps it
        from peft.utils.other import fsdp_auto_wrap_policy
        model = add_lora(model, recipe.lora)
        policy = fsdp_auto_wrap_policy(model)
    pinned = []
    torch.Tensor.pin_memory = lambda t, *a, **k: pinned.append(t.numel() * t.element_size()) or t.clone()
    wrapped = FSDP(model, auto_wrap_policy=policy, cpu_offload=CPUOffload(offload_params=True), device_id=torch.device("cpu"),
                   use_orig_params=recipe.fsdp.use_orig_params, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    for unit in FSDP.fsdp_modules(wrapped):  # accelerate's prepare: a trained 16-bit flat parameter upcast to fp32
        flat = unit._flat_param if unit._has_params else None
        if flat is not None and flat.requires_grad and flat.dtype != torch.float32:
            flat.data, unit._handle._orig_param_dtype = flat.data.float(), torch.float32
    from torch.distributed.fsdp._runtime_utils import _lazy_init
    _lazy_init(wrapped, wrapped)  # (where FSDP pins its shards, as at the first forward)
    print("PINNED", json.dumps(sorted(pinned)))
""")


@pytest.mark.parametrize("recipe, words", [
    ("fsdp", ["fsdp.version=1"]),  # a full fine-tune's fp32 flat parameters, aligned (use_orig_params)
    ("fsdp-lora", ["fsdp.version=1", "fsdp.use_orig_params=false", "lora.r=8", "lora.target_modules=all-linear"]),
    ("fsdp-qlora", ["lora.r=8", "lora.target_modules=all-linear"])], ids=["full", "lora", "qlora"])
def test_the_tensors_fsdp1s_offload_pins_are_the_plans(recipe, words):
    """FSDP1's parameter offload, built as the loop builds it (the loop's loading and LoRA, PEFT's wrap policy with
    flat parameters, bf16 mixed precision, accelerate's upcast) over three processes (a fake process group, on the
    CPU device: 128 rows do not split evenly, so each shard's padding is checked too) through its lazy init: every tensor torch pins (each flat parameter's shard and its `_cpu_grad`,
    frozen or not; a 4-bit base's packed weights in its storage dtype), recorded, is one
    states.fsdp1_host_tensors lists, of the same bytes; the plan's pinned host figure is three processes' blocks."""
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.states import optimizer_state_bytes
    from memrecipe.planning.topology import Topology

    done = subprocess.run([sys.executable, "-c", FSDP1, recipe, *words], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PINNED")).split(" ", 1)[1])
    r, s = load_recipe(recipe, [*words, "fsdp.offload_params=true"]), structure(read_config(embedded_model()))
    train = trainable_tensors(r, s)
    assert recorded == sorted(fsdp1_host_tensors(r, s, train, 3, 2))
    est = estimate(r, s, Topology(3))
    assert est.host_pinned == 3 * pinned_bytes(recorded, [])  # three processes on the machine
    assert est.host_offload - est.host_pinned == optimizer_state_bytes(r, train, 4)  # (a third a process, pageable)


def test_an_fsdp1_flat_parameter_aligns_each_tensor_and_pads_to_a_chunk_a_process():
    """_flat_param.py: under use_orig_params each tensor starts at a multiple of 16 bytes of the compute dtype, and
    each process's chunk is the padded whole over the processes."""
    assert flat_shard([3, 5], 2) == 4 and flat_shard([3, 5], 2, aligned=8) == 7  # (3, 5 padding, 5: 13 over two)
    assert flat_shard([16, 16], 3, aligned=8) == 11


DPO_COPY = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from types import SimpleNamespace
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.loading import embedded_model
    from memrecipe.training.reference import frozen_copy
    recipe = load_recipe("fsdp", ["fsdp.offload_params=true", "dpo.precompute_ref_log_probs=false"], script="dpo")
    plugin = SimpleNamespace(mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                             cpu_offload=CPUOffloadPolicy())  # (accelerate's, for fsdp.offload_params)
    accelerator = SimpleNamespace(mixed_precision="bf16", device=torch.device("cpu"), torch_device_mesh=None,
                                  distributed_type=SimpleNamespace(value="FSDP"), state=SimpleNamespace(fsdp_plugin=plugin))
    pinned = []
    torch.Tensor.pin_memory = lambda t, *a, **k: pinned.append(t.numel() * t.element_size()) or t.clone()
    frozen_copy(recipe, embedded_model(), accelerator)
    print("PINNED", json.dumps(sorted(pinned)))
""")


def test_dpos_copy_under_fsdp2s_offload_pins_each_shard_in_host_memory_as_planned():
    """DPO's frozen copy of a full fine-tune under FSDP2's parameter offload (training.reference.frozen_copy, over a
    fake three-process group on the CPU device): torch pins each parameter's shard of it, in the weights' dtype (fp32
    here), and nothing else; the plan puts the copy in host memory, pinned, to the byte, and none of it on the GPU."""
    from memrecipe.planning.planner import estimate
    from memrecipe.planning.topology import Topology

    done = subprocess.run([sys.executable, "-c", DPO_COPY], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PINNED")).split(" ", 1)[1])
    s = structure(read_config(embedded_model()))
    assert recorded == sorted(4 * fsdp2_shard(t, 3) for t in s.tensors())
    policy, both = (estimate(load_recipe("fsdp", ["fsdp.offload_params=true", *w], script="dpo"), s, Topology(3))
                    for w in ([], ["dpo.precompute_ref_log_probs=false"]))
    assert both.host_pinned - policy.host_pinned == both.host_offload - policy.host_offload == 3 * pinned_bytes(recorded, [])
    assert both.parameters == policy.parameters
