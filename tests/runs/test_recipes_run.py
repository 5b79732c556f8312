"""Every recipe really trains on CPU (the smoke-test mode): loss falls, the model is wrapped as
the recipe says, every rank knows the world, and the saved model reloads and is the trained one.

Each recipe runs once per session (a module fixture, two launches side by side); several tests assert on that run.
"""

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from helpers import SideBySide, free_port, launch, loop_model, pin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SHORT = ["max_steps=20", "eval_steps=10", "logging_steps=5", "max_seq_length=64"]  # packed rows of 64: ~1,000 tokens a step


ONE_PROCESS = ("single-gpu-lora", "adamw-8bit", "single-gpu-full", "qlora")


def memrecipe_run(folder, recipe, *args, core=None):
    done = launch(["memrecipe", "run", "sft", "--recipe", recipe, "--output-dir", str(folder), "--main-process-port",
                   str(free_port()), *args, *SHORT], preexec_fn=pin(core))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (folder.parent / f"{folder.name}.launch.log").write_text(done.stdout + done.stderr)  # what the user saw
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """recipe -> run folder. Every recipe is launched once, two at a time, in the order the tests ask for them;
    a test waits for its own."""
    base = tmp_path_factory.mktemp("runs")

    def start(name, core):
        folder = base / name
        core = core if name in ONE_PROCESS else None  # a 1-process run pinned: 2 threads each would thrash
        if name == "single-gpu-lora":  # the copy path: memrecipe cp, then plain accelerate launch from DEST
            dest = base / "copied"
            assert launch(["memrecipe", "cp", name, str(dest)]).returncode == 0
            from memrecipe.planning.registry import EMBEDDED_DATASET

            done = launch(["--config_file", "single_gpu_lora_cpu1.yaml", "--num_cpu_threads_per_process", "1",
                           "sft.py", "--recipe", "single-gpu-lora.yaml", "--dataset", str(EMBEDDED_DATASET),
                           "--output-dir", str(folder), *SHORT, "report_to=tensorboard"], cwd=dest,
                          preexec_fn=pin(core))  # --dataset: the same words as memrecipe run
            assert done.returncode == 0, done.stderr[-3000:]
            (base / "copied.log").write_text(done.stdout + done.stderr)
        elif name == "adamw-8bit":
            memrecipe_run(folder, name, "--num-processes", "1", "--memory-snapshot", core=core)
        elif name == "fsdp-lora":  # with a checkpoint of the trained weights at the last step
            memrecipe_run(folder, name, "save_steps=20")
        elif name == "qlora":  # and the activation offload knob, end to end, and one step's profile
            memrecipe_run(folder, name, "activation_offload=true", "--profile", core=core)
        else:
            memrecipe_run(folder, name, core=core)
        return folder

    def loading():  # FSDP2 on a 42M-parameter model (170 MB in fp32): what each rank holds as it loads
        folder = base / "loading"
        done = launch(["memrecipe", "run", "sft", "--recipe", "fsdp", "--num-processes", "2", "--model",
                       str(jobs("mid-model")), "--output-dir", str(folder), "--main-process-port", str(free_port()),
                       "max_steps=1", "eval_size=0", "max_seq_length=64", "per_device_train_batch_size=2",
                       "gradient_accumulation_steps=1"], preexec_fn=pin(None))  # (its config's cpu_ram_efficient_loading: true)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return folder

    order = ["single-gpu-lora", "fsdp", "zero3-offload", "ddp", "zero2", "adamw-8bit", "single-gpu-full", "fsdp-lora",
             "qlora", "zero3-ulysses"]
    jobs = SideBySide({**{name: (lambda core, name=name: start(name, core)) for name in order},
                       "mid-model": lambda core: mid_model(base / "mid"),
                       "loading": lambda core: loading()})
    yield jobs
    jobs.close()


def mid_model(folder):
    """The embedded model's shape widened to 42M parameters, saved in bf16 as real checkpoints are (a full fine-tune
    loads them as fp32 masters: each loading rank converts, and so holds, the whole model), with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from memrecipe.planning.registry import EMBEDDED_MODEL

    config = AutoConfig.from_pretrained(EMBEDDED_MODEL)
    config.update({"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 6,
                   "num_key_value_heads": 6, "head_dim": 128})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(EMBEDDED_MODEL).save_pretrained(folder)
    return folder


def test_fsdp2_loads_the_weights_on_rank_0_alone_and_broadcasts_them(runs):
    """fsdp's cpu_ram_efficient_loading (its config's, on CPU too): rank 1 builds the model without weights and holds
    less host RAM up to its first step than rank 0 by most of the model's bytes (every rank loading its own copy, the
    two would hold about the same). The shards rank 1 received are rank 0's weights: step 1 trains at a learning rate
    of 0 (the warm-up's first step), so the saved model, gathered from both ranks' shards, is the checkpoint's."""
    from safetensors.torch import load_file

    efficient = report(runs("loading"))
    model_bytes = 4 * efficient["setup"]["params"]
    rank0, rank1 = (p["load_peak_rss_bytes"] for p in sorted(efficient["processes"], key=lambda p: p["process_index"]))
    assert rank0 - rank1 > 0.4 * model_bytes, (rank0, rank1, model_bytes)
    assert [h["lr"] for h in efficient["history"]] == [0.0]
    saved = load_file(runs("loading") / "final" / "model.safetensors")
    loaded = load_file(runs("mid-model") / "model.safetensors")  # bf16, as real checkpoints are
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k].float()) for k in saved)


def report(folder):
    return json.loads((Path(folder) / "report.json").read_text())


def reload_eval_loss(folder, model):
    """The eval loss of a reloaded model on the run's own eval split, computed as the loop does."""
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training.data import Collator, prepare_datasets
    from memrecipe.training.loss import count_targets, model_inputs, token_loss
    from memrecipe.training.tokenizer import load_tokenizer

    recipe = load_recipe(str(Path(folder) / "recipe.yaml")) if (Path(folder) / "recipe.yaml").exists() \
        else load_recipe(report(folder)["recipe"]["name"], SHORT)
    tokenizer = load_tokenizer(str(Path(folder) / "final"))
    _, eval_set = prepare_datasets(recipe, tokenizer)
    loader = torch.utils.data.DataLoader(eval_set, batch_size=recipe.per_device_train_batch_size,
                                         collate_fn=Collator(tokenizer.pad_token_id))
    total = count = 0.0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in loader:
            logits = model(**model_inputs(batch)).logits
            total += token_loss(logits, batch["labels"]).item()
            count += count_targets(batch)
    return total / count


def assert_learned(folder, processes):
    r = report(folder)
    losses = [h["loss"] for h in r["history"]]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses  # the loss clearly falls
    assert r["final_eval_loss"] < 0.8 * losses[0]
    ranks = sorted((p["process_index"], p["num_processes"]) for p in r["processes"])
    assert ranks == [(i, processes) for i in range(processes)]  # every rank knows the world and itself
    return r


def assert_full_model_saved(folder, tolerance):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = Path(folder) / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tensors = dict(model.named_parameters())
    assert tensors and all(t.numel() > 0 and t.abs().sum() > 0 for t in tensors.values())
    assert AutoTokenizer.from_pretrained(final).chat_template
    assert reload_eval_loss(folder, model) == pytest.approx(report(folder)["final_eval_loss"], rel=tolerance)
    return model


def test_single_gpu_lora_trains_from_a_copied_folder(runs):
    folder = runs("single-gpu-lora")
    r = assert_learned(folder, 1)
    s = r["setup"]
    assert s["trainable_names_all_lora"] and 0 < s["trainable_params"] < s["params"] / 4
    assert s["gradient_checkpointing"] and s["mixed_precision"] == "bf16"
    # a copied script given lora.redraw_dropout: auto (no plan decided it) redraws: the memory-safe choice
    assert r["recipe"]["lora"]["redraw_dropout"] == "auto" and s["lora_recomputed_dropout"] == 7 * 4
    from memrecipe.training.cpu_matmul import bf16_gemm_native

    # bf16 on a CPU without a bf16 GEMM: its matmuls as fp32 GEMMs (training/cpu_matmul.py), said at start-up
    assert s["bf16_matmuls_in_fp32"] is not bf16_gemm_native()
    assert ("matmuls as fp32 GEMMs" in (folder.parent / "copied.log").read_text()) is s["bf16_matmuls_in_fp32"]
    assert s["allocator_conf"] == ("PYTORCH_ALLOC_CONF=expandable_segments:True,pinned_max_cached_size_mb:64")  # memrecipe's
    # default, on a plain launch
    from memrecipe.planning.registry import EMBEDDED_DATASET

    assert r["recipe"]["dataset"] == str(EMBEDDED_DATASET)  # sft.py --dataset reached the recipe
    log = (folder.parent / "copied.log").read_text()
    assert "data: train: messages format" in log and "are targets" in log  # what the loss learns from
    # attn_implementation: auto, resolved on the process's device and read back off the loaded model
    assert (r["recipe"]["attn_implementation"], s["attention"]) == ("auto", "sdpa")
    assert f"attention: sdpa ({s['attention_why']})" in log and s["attention_why"].startswith("auto: on CPU")
    assert all(0 < h["targets"] < h["tokens"] for h in r["history"])  # chat data: only the assistant's tokens
    # the fused loss's peak, measured on the first micro batch: within what the plan gives a full-length batch
    (rank,) = r["processes"]
    assert 0 < rank["held"]["logits"] <= r["plan"]["logits"]
    from memrecipe.report import card

    cells = next(line for line in card(r).splitlines() if line.startswith("logits")).split()
    assert cells[-2] != "-"  # the card shows the measurement, not a dash, and what the plan missed by
    assert float(cells[-1]) == pytest.approx((rank["held"]["logits"] - r["plan"]["logits"]) / 2**30, rel=0.01)
    assert f"attention: sdpa ({s['attention_why']})" in card(r).splitlines()


def test_single_gpu_lora_adapter_reloads_and_is_the_trained_one(runs):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = runs("single-gpu-lora")
    final = folder / "final"
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values())
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in adapter.items())  # B starts at zero: it trained
    base_path = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.bfloat16), final)
    assert reload_eval_loss(folder, model) == pytest.approx(report(folder)["final_eval_loss"], rel=1e-5)


def test_fsdp_shards_over_two_processes_and_saves_the_full_model(runs):
    folder = runs("fsdp")
    r = assert_learned(folder, 2)
    s = r["setup"]
    assert s["distributed_type"] == "FSDP" and s["fsdp2_modules"] >= 5  # 4 decoder layers + the root
    assert s["dtensor_params"] > 0  # parameters are sharded DTensors
    for name in ("recipe.yaml", "accelerate_config.yaml", "train.log", "report.json"):
        assert (folder / name).is_file(), name
    log = (folder / "train.log").read_text()
    assert "step 20/20" in log
    assert f"run folder {folder.resolve()}: final/" in log.strip().splitlines()[-1]  # the last line says where
    # FSDP2 computed every op in bf16 (param_dtype), the reload under bf16 autocast keeps norms and softmax in fp32:
    # about one bf16 step apart (2^-8 = 0.4%: 0.05% measured on AVX-512 CPUs, 0.42% on AVX2 ones, whose CPU kernels
    # round differently); a wrong or untrained save is ~50% off (the loss falls from 6.8 to 3.4)
    assert_full_model_saved(folder, tolerance=1e-2)


def test_zero3_offload_partitions_offloads_and_gathers_16bit_weights(runs):
    folder = runs("zero3-offload")
    r = assert_learned(folder, 2)
    s = r["setup"]
    assert (s["zero_stage"], s["zero_offload_optimizer"], s["zero_offload_param"]) == (3, True, True)
    assert s["client_optimizer_class"] == "DeepSpeedCPUAdam"
    assert f"DeepSpeed's CPU Adam: {s['cpu_threads']} CPU thread(s) per process" in (folder / "train.log").read_text()
    assert json.loads((folder / "deepspeed_config.json").read_text())["zero_optimization"]["stage"] == 3
    model = assert_full_model_saved(folder, tolerance=1e-5)
    assert next(model.parameters()).dtype == torch.bfloat16  # the 16-bit weights gathered at save


def test_zero3_ulysses_splits_each_sequence_over_the_two_processes(runs):
    """As shipped (bf16, the ALST set): sp resolves to the 2 processes, DeepSpeed's Ulysses attention is what
    transformers calls, the loss falls, the full model is gathered at save and reloads (eval runs whole sequences on
    each process). Its exactness against one process: tests/runs/test_sequence_parallel.py."""
    folder = runs("zero3-ulysses")
    r = assert_learned(folder, 2)
    s = r["setup"]
    assert (s["sequence_parallel"], s["ulysses_attention"], s["zero_stage"], s["mixed_precision"]) == (2, True, 3, "bf16")
    assert s["tiled_mlps"] == 4 and s["lean_norms"] and s["gradient_checkpointing"]
    assert r["recipe"]["parallelism"]["sp_size"] == 2 and not r["recipe"]["packing"]
    assert all(h["grad_norm"] > 0 for h in r["history"])  # the engine's norm, before its clipping
    log = (folder.parent / "zero3-ulysses.launch.log").read_text()
    assert "sequence parallel: Ulysses over groups of 2 processes (DeepSpeed)" in log
    assert "batch: 4 sequences x 1 accumulation x 1 data-parallel process(es) per step" not in log  # micro batch 1
    assert "batch: 1 sequences x 1 accumulation x 1 data-parallel process(es) per step" in log
    assert "parallelism_config_sp_size: 2" in (folder / "accelerate_config.yaml").read_text()
    # the run's eval split each sequence over 2 processes (heads exchanged, each process's loss summed apart, in bf16),
    # the reload runs it whole on one: 0.6e-5 apart when every weight was in one optimizer group, 2.6e-5 with the two
    # the loop makes (decayed matrices, undecayed norms), whose weights end a little apart; a wrong or untrained save
    # is ~50% off
    assert_full_model_saved(folder, tolerance=1e-4)


def test_ddp_is_the_plain_data_parallel_baseline(runs):
    folder = runs("ddp")
    r = assert_learned(folder, 2)
    s = r["setup"]
    assert s["model_class"] == "DistributedDataParallel" and not s["gradient_checkpointing"]
    assert s["optimizer_class"] == "AdamW" and s["trainable_params"] == s["params"]
    for p in r["processes"]:  # each process's whole model states, DDP's gradient buckets counted as gradients
        for category in ("parameters", "gradients", "optimizer_state"):
            assert p["held"][category] == pytest.approx(r["plan"][category], rel=0.01), category
    assert_full_model_saved(folder, tolerance=1e-5)


def test_zero2_partitions_and_offloads_the_optimizer(runs):
    folder = runs("zero2")
    r = assert_learned(folder, 2)
    s = r["setup"]
    assert (s["zero_stage"], s["zero_offload_optimizer"], s["zero_offload_param"]) == (2, True, False)
    assert s["client_optimizer_class"] == "DeepSpeedCPUAdam"
    assert_full_model_saved(folder, tolerance=1e-4)


def test_adamw_8bit_keeps_8bit_optimizer_state(runs):
    folder = runs("adamw-8bit")
    r = assert_learned(folder, 1)
    s = r["setup"]
    assert s["optimizer_class"] == "AdamW8bit" and "uint8" in s["optimizer_state_dtypes"]
    assert s["gradient_checkpointing"] and s["trainable_params"] == s["params"]
    assert_full_model_saved(folder, tolerance=1e-5)


def test_single_gpu_full_trains_bf16_weights_with_the_step_in_backward(runs):
    folder = runs("single-gpu-full")
    r = assert_learned(folder, 1)
    s = r["setup"]
    assert s["optimizer_class"] == "TorchaoAdamW8bit" and s["optimizer_in_backward"]
    assert s["bf16_update_rounding"] == "stochastically" and s["optimizer_first_use"] == ""  # (no compile on CPU)
    assert "weights: bf16, no fp32 master; optim adamw_torch_8bit rounds each update stochastically" in \
        (folder / "train.log").read_text()
    assert {"uint8", "float32"} <= set(s["optimizer_state_dtypes"])  # 8-bit moments; fp32 for the embeddings
    assert s["gradient_checkpointing"] and s["trainable_params"] == s["params"]
    (held,) = [p["held"] for p in r["processes"]]
    assert held["parameters"] == 2 * s["params"]  # bf16, no fp32 master anywhere
    assert held["gradients"] < 0.1 * held["parameters"]  # one tensor's gradient at a time, not the model's
    model = assert_full_model_saved(folder, tolerance=1e-4)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_fsdp_lora_shards_the_base_and_saves_the_trained_adapter(runs):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = runs("fsdp-lora")
    r = assert_learned(folder, 2)
    s = r["setup"]
    assert s["distributed_type"] == "FSDP" and s["fsdp2_modules"] >= 5 and s["dtensor_params"] > 0
    assert s["gradient_checkpointing"] and s["trainable_names_all_lora"]  # the model's own checkpointing
    frozen, trained = s["params"] - s["trainable_params"], s["trainable_params"]
    for p in r["processes"]:  # half of a bf16 base and of the fp32 adapters on each of the 2 processes
        assert p["held"]["parameters"] == pytest.approx((2 * frozen + 4 * trained) / 2, rel=0.05)
    final = folder / "final"
    adapter = load_file(final / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 4 and all(t.numel() > 0 for t in adapter.values())  # A and B of 28 linears
    # equal to the trained weights, as the step-20 checkpoint gathered them from the shards
    trained = torch.load(folder / "checkpoints" / "step-20" / "pytorch_model_fsdp.bin", weights_only=True)
    for key, tensor in adapter.items():
        assert torch.equal(tensor, trained[key.replace(".weight", ".default.weight")]), key
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in adapter.items())
    base_path = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.bfloat16), final)
    # FSDP computed the adapters in bf16 (its mixed-precision policy), the reload under autocast: ~0.2% on
    # packed rows (an untrained adapter is off by ~80%)
    assert reload_eval_loss(folder, model) == pytest.approx(r["final_eval_loss"], rel=5e-3)


def test_qlora_trains_only_adapters_on_a_4bit_base(runs):
    folder = runs("qlora")
    r = assert_learned(folder, 1)
    s = r["setup"]
    assert s["quantized_weights"] == 4 * 7  # every linear of the 4 decoder layers is a bitsandbytes 4-bit weight
    assert s["trainable_names_all_lora"] and 0 < s["trainable_params"] < s["params"] / 4
    assert s["gradient_checkpointing"] and s["optimizer_class"] == "AdamW8bit"  # paged only on CUDA
    # activation offload: one saved input per checkpointed layer (bf16 hidden states: nothing is upcast)
    assert 0 < s["offloaded_bytes_per_micro_batch"] <= 4 * 4 * 256 * 128 * 2  # layers x batch x seq x hidden x bf16
    assert "activation offload:" in (folder / "train.log").read_text()
    # lora.redraw_dropout: auto, decided by memrecipe run's plan: peft's dropout, as the run fits with it (its masks
    # kept, no adapter's checkpoint); the run folder's recipe says so, and the start-up line
    assert r["recipe"]["lora"]["redraw_dropout"] is False and r["recipe"]["lora"]["dropout"] > 0
    assert s["lora_recomputed_dropout"] == 0 and "LoRA's dropout as peft's" in (folder / "train.log").read_text()


def test_qlora_adapter_reloads_onto_the_quantized_base(runs):
    from dataclasses import replace

    from peft import PeftModel
    from safetensors.torch import load_file

    from memrecipe.planning.registry import load_recipe

    folder = runs("qlora")
    final = folder / "final"
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all("lora_" in k and t.numel() > 0 for k, t in adapter.items())
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in adapter.items())  # B starts at zero: it trained
    recipe = load_recipe("qlora", SHORT)
    base_path = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    base, _ = loop_model(replace(recipe, lora=None, gradient_checkpointing=False), base_path, "bf16")
    assert type(base.model.layers[0].mlp.down_proj.weight).__name__ == "Params4bit"
    model = PeftModel.from_pretrained(base, final)
    assert reload_eval_loss(folder, model) == pytest.approx(report(folder)["final_eval_loss"], rel=1e-4)


# The report card (issue: what the run measured next to what the planner predicted).

@pytest.mark.parametrize("name", ["single-gpu-lora", "adamw-8bit", "qlora", "single-gpu-full"])
def test_one_process_model_states_match_the_plan(runs, name):
    r = report(runs(name))
    (held,) = [p["held"] for p in r["processes"]]
    for category in ("parameters", "gradients", "optimizer_state"):
        assert held[category] == pytest.approx(r["plan"][category], rel=0.01), category  # the planner's tolerance


@pytest.mark.parametrize("name", ["fsdp", "fsdp-lora"])
def test_fsdp_holds_after_the_step_what_the_plan_says_without_its_gathered_units(runs, name):
    """The plan counts a step's peak: the shards plus the units FSDP gathers while a layer computes (the running one
    and the prefetched one) and, for a full fine-tune, a unit's full gradients before the reduce-scatter. Held bytes
    are read after the step, resharded: the plan less what it calls gathered, and the card says so."""
    from memrecipe.report import card

    r = report(runs(name))
    plan = r["plan"]
    assert plan["gathered_params"] > 0 and (plan["gathered_grads"] > 0) is (name == "fsdp")
    for p in r["processes"]:
        assert p["held"]["parameters"] == pytest.approx(plan["parameters"] - plan["gathered_params"], rel=0.01)
        assert p["held"]["gradients"] == pytest.approx(plan["gradients"] - plan["gathered_grads"], rel=0.01)
    assert "GiB of the plan are gathered only while a layer computes (FSDP's running and prefetched unit)" in card(r)


@pytest.mark.parametrize("name, bytes_per_param", [("fsdp", 4), ("zero3-offload", 2)])
def test_sharded_recipes_hold_half_the_parameters_per_process(runs, name, bytes_per_param):
    r = report(runs(name))
    params = r["setup"]["params"]
    for p in r["processes"]:  # FSDP: fp32 local shards; ZeRO-3: bf16 partitions
        assert p["held"]["parameters"] == pytest.approx(bytes_per_param * params / 2, rel=0.05)
    zero = r["processes"][0]["held"]
    if name == "zero3-offload":  # fp32 master + two moments of this rank's half
        assert zero["optimizer_state"] == pytest.approx(12 * params / 2, rel=0.05)
        # its gradients: the partitions beside the reduce bucket stage3.py allocates (5e8 bf16 elements), as planned
        plan = r["plan"]
        assert zero["gradients"] == plan["gradients"] - plan["gathered_grads"] > 2 * 500_000_000


def test_report_json_and_card_hold_what_was_measured(runs, cli, tmp_path):
    folder = runs("adamw-8bit")
    r = report(folder)
    assert set(r["versions"]) >= {"torch", "accelerate", "transformers", "peft", "deepspeed", "bitsandbytes"}
    assert r["versions"]["torch"] and r["resolved_config"]["distributed_type"] == "NO"
    assert r["throughput"]["tokens_per_second"] > 0 and r["throughput"]["mfu"] is None  # no GPU: no MFU
    assert all({"step", "loss", "lr", "tokens", "seconds"} <= set(h) for h in r["history"])
    first, rest = r["history"][0], r["history"][1:]  # the first step is warm-up: the speed is read after it
    assert r["throughput"]["warmup_seconds"] == first["seconds"] and rest
    assert r["throughput"]["tokens_per_second"] == pytest.approx(sum(h["tokens"] for h in rest) /
                                                                 sum(h["seconds"] for h in rest))
    # the step-time forecast at the CPU's rates beside what the run measured (the ratio: padded slots a second)
    assert r["plan"]["tokens_per_second"] == r["throughput"]["forecast_tokens_per_second"] > 0
    assert r["throughput"]["measured_vs_forecast"] == pytest.approx(
        sum(h.get("slots", h["tokens"]) for h in rest) / sum(h["seconds"] for h in rest)
        / r["throughput"]["forecast_tokens_per_second"])
    umask = os.umask(0)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (folder / "final").iterdir()} == {0o666 & ~umask}  # not 0600
    assert r["plan"]["total"] > 0 and r["advice"].startswith("CPU smoke test passed")
    assert (folder / "loss.png").stat().st_size > 10_000
    log = (folder / "train.log").read_text()
    assert "memrecipe report: adamw-8bit" in log and "optimizer state" in log
    again = cli("report", str(folder))
    assert again.returncode == 0 and "PLANNED" in again.stdout and "throughput after the first step (" in again.stdout
    chart = tmp_path / "compare.png"
    both = cli("compare", str(folder), str(runs("single-gpu-lora")), "--plot", str(chart))
    assert both.returncode == 0 and "adamw-8bit" in both.stdout and "single-gpu-lora" in both.stdout
    assert chart.stat().st_size > 10_000


def test_cpu_memory_snapshot_is_the_profilers_timeline_by_category(runs):
    timeline = json.loads((runs("adamw-8bit") / "memory_timeline_rank0.json").read_text())
    times, sizes = timeline
    assert len(times) == len(sizes) > 10 and max(max(s) for s in sizes) > 0


def test_profile_says_where_the_second_steps_time_goes(runs):
    """--profile: step 2 (after the warm-up) under torch's profiler, its ops by their own time, and a trace."""
    folder = runs("qlora")
    table = (folder / "profile_rank0.txt").read_text()
    assert table.startswith("step 2: ") and "aten::mm" in table and "Self CPU" in table
    trace = json.loads((folder / "profile_rank0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert "profile of step 2: profile_rank0.txt" in (folder / "train.log").read_text()


def test_tensorboard_event_file_holds_the_loss(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (runs("single-gpu-lora") / "tracking").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("loss")]
    assert len(losses) == 20 and losses[-1] < losses[0]


def test_every_recipe_that_runs_on_cpu_is_run_here():
    """`memrecipe ls` says which recipes run end to end on CPU: each of those has a run test above."""
    from memrecipe.planning.registry import load_recipe, recipe_names

    source = Path(__file__).read_text()
    for name in recipe_names():
        if load_recipe(name).supports.cpu:
            assert f'runs("{name}")' in source, f"{name} claims a CPU run but no test runs it"


def test_a_launch_is_quiet_and_its_folder_says_how_to_run_it(runs):
    """What a person reads: the engine in words, no DeepSpeed notice that it guessed the CPU, and the run folder's
    launch config headed by the Run line its comments refer to."""
    folder = runs("zero3-offload")
    said = (folder.parent / f"{folder.name}.launch.log").read_text()
    assert "2 process(es), DeepSpeed on cpu" in said and "Setting accelerator to CPU" not in said
    assert "1 process(es), plain (no DDP/FSDP/DeepSpeed) on cpu" in (runs("adamw-8bit") / "train.log").read_text()
    config = (folder / "accelerate_config.yaml").read_text()
    run_line = next(line for line in config.splitlines() if line.startswith("# Run:"))
    assert "--config_file accelerate_config.yaml" in run_line and "--recipe recipe.yaml --resume --output-dir ." in run_line
