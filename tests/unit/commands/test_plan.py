"""memrecipe plan: every recipe planned for a model and a machine, one recommendation per training method, and bad input in one line."""

import json
import re

import pytest

from memrecipe.planning.architecture import read_config, structure
from memrecipe.planning.planner import estimate, judge
from memrecipe.planning.registry import load_recipe
from memrecipe.planning.topology import Topology
from model_configs import LLAMA_8B


def test_plan_recommends_and_finds_micro_batch_and_accumulation(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32, "tie_word_embeddings": False}))
    done = cli("plan", "--model", str(folder), "--gpu-memory", "24GiB", "--host-memory", "256GiB",
               "max_seq_length=2048", "per_device_train_batch_size=1")
    assert done.returncode == 0, done.stderr
    assert "8.030B parameters" in done.stdout and "LoRA: single-gpu-lora: the fastest" in done.stdout
    assert "adamw-8bit" in done.stdout and "no (GPU -" in done.stdout  # which resource is short
    data = json.loads(cli("plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "8",
                          "--host-memory", "1TiB", "--global-batch", "512", "--json", "max_seq_length=2048").stdout)
    fsdp = next(e for e in data["estimates"] if e["recipe"] == "fsdp")
    micro, acc = (int(x) for x in fsdp["batch"].split(" x "))
    assert micro * acc * 8 == 512 and fsdp["fits"] and fsdp["micro_batch"] == micro and acc > 1
    # the next micro batch that divides the 64 sequences per process does not fit (so the pick is the largest)
    bigger = min(m for m in range(micro + 1, 65) if 64 % m == 0)
    over = estimate(load_recipe("fsdp", [f"per_device_train_batch_size={bigger}", "max_seq_length=2048"]),
                    structure(read_config(str(folder))), Topology(8))
    assert not judge(over, 80 * 10**9, 2**40).fits and over.total > 80 * 10**9
    plot = tmp_path / "plan.png"
    assert cli("plan", "--model", str(folder), "--gpu-memory", "24GiB", "--plot", str(plot)).returncode == 0
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize("args, words", [
    (["--model", "someone/not-here", "--gpu-memory", "24GiB"], "cannot read config.json"),
    (["--gpu-memory", "lots"], "'lots' is not a size"),
    (["--gpu-memory", "24GiB", "--host-memory", "24"], "'24' is not a size"),
    ([], "no GPU found here: give --gpu-memory"),
    (["--gpu-memory", "1GiB", "per_device_train_batch_size=64"], "nothing fits"),
    (["--gpu-memory", "24GiB", "lora.r=0"], "lora.r must be >= 1"),
    (["--gpu-memory", "24GiB", "--num-processes", "0"], "--num-processes must be >= 1, got 0"),
])
def test_plan_bad_input_is_one_line_exit_2(cli, args, words, tmp_path):
    done = cli("plan", *args)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


def test_not_a_causal_lm_is_refused(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 64}))
    done = cli("plan", "--model", str(tmp_path), "--gpu-memory", "24GiB")
    assert done.returncode == 2 and "not a causal language model" in done.stderr


def test_plan_recommends_the_bf16_full_fine_tune_on_one_gpu(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    args = ["plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "1", "--host-memory", "64GiB",
            "--method", "full", "--json"]
    data = json.loads(cli(*args).stdout)
    assert data["recommendations"]["full"]["recipe"] == "single-gpu-full"
    fits = {e["recipe"]: e["fits"] for e in data["estimates"]}
    assert not fits["adamw-8bit"] and not fits["zero3-offload"]  # 80 GB of GPU; 145 GB of offload in 64 GiB of RAM


def test_plan_recommends_within_each_training_method(cli, tmp_path):
    """Full fine-tuning, LoRA and QLoRA are a choice of quality: on 8 x 80 GB an 8B full fine-tune fits
    (fsdp), and it is recommended as such, not traded for LoRA's faster steps."""
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    args = ["plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "8", "--host-memory", "1TiB"]
    data = json.loads(cli(*args, "--json").stdout)
    picks = {m: r["recipe"] for m, r in data["recommendations"].items()}
    assert picks == {"full": "fsdp", "lora": "fsdp-lora", "qlora": "fsdp-qlora"}
    assert {e["recipe"]: e["method"] for e in data["estimates"]}["fsdp"] == "full"
    text = cli(*args).stdout
    assert "full fine-tune: fsdp: the fastest recipe that fits" in text and "LoRA: fsdp-lora" in text
    only = cli(*args, "--method", "full", "--json")
    assert json.loads(only.stdout)["recommendations"] == {"full": data["recommendations"]["full"]}


def test_plan_for_other_machines_gpus_does_not_judge_them_by_this_machines_ram(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    args = ["plan", "--model", str(folder), "--gpu-memory", "80GB", "--num-processes", "8"]
    text = cli(*args).stdout
    assert "host RAM not given (--host-memory): HOST is not checked" in text
    data = json.loads(cli(*args, "--json").stdout)
    assert data["host_memory"] is None
    assert {e["recipe"]: e["fits"] for e in data["estimates"]}["zero3-offload"]  # not refused by a laptop's RAM
    given = json.loads(cli(*args, "--host-memory", "64GiB", "--json").stdout)
    assert not {e["recipe"]: e["fits"] for e in given["estimates"]}["zero3-offload"]  # 135 GiB of offload > 64


@pytest.mark.parametrize("content, words", [
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}',
     "lacks intermediate_size"),
    ('{"model_type": "llama",', "is not valid JSON"),
])
def test_a_broken_model_config_is_one_line_in_plan_and_run(cli, tmp_path, content, words):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(content)
    model = str(tmp_path / "model")
    for args in (["plan", "--model", model, "--gpu-memory", "24GiB"],
                 ["run", "sft", "--recipe", "single-gpu-lora", "--model", model, "--output-dir", str(tmp_path / "r")],
                 ["run", "sft", "--recipe", "single-gpu-lora", "--model", model, "--dry-run", "--force",
                  "--output-dir", str(tmp_path / "r")]):
        done = cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr[-500:])
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists(), args
    assert words in cli("plan", "--model", model, "--gpu-memory", "24GiB").stderr


def test_plan_shows_each_rows_batch_and_what_binds_when_nothing_fits(cli, tmp_path):
    """Each row's micro batch x tokens (recipes differ; a real model's rows, the embedded model's own), the host RAM each recommendation needs, and, when the host RAM is what binds, that and its remedy."""
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    done = cli("plan", "--model", str(folder), "--gpu-memory", "24GB")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:4] for line in done.stdout.splitlines() if line.split()[:1] in
            (["single-gpu-full"], ["single-gpu-lora"])}
    assert rows == {"single-gpu-full": ["8", "x", "2048"], "single-gpu-lora": ["4", "x", "2048"]}  # a real job's
    assert "host RAM 119.7 GiB per machine (not checked: give --host-memory)" in done.stdout  # zero2's
    small = cli("plan", "--cpu")  # the embedded model: its own rows of 256 tokens
    assert [line.split()[1:4] for line in small.stdout.splitlines() if line.startswith("single-gpu-lora ")] == \
        [["4", "x", "256"]]
    host = cli("plan", "--model", str(folder), "--gpu-memory", "24GB", "--host-memory", "64GiB", "--method", "full")
    assert host.returncode == 2 and "nothing fits in host RAM: the least is zero2 at 119.7 GiB per machine" in host.stderr
    table = cli("plan", "--model", str(folder), "--gpu-memory", "80GB", "--host-memory", "64GiB")
    zero2 = next(line for line in table.stdout.splitlines() if line.startswith("zero2 "))
    assert "no (host -" in zero2
    assert "more host RAM, use more machines" in host.stderr and "per_device_train_batch_size=1" not in host.stderr


def test_plan_longest_finds_each_recipes_longest_sequence_its_rung_and_host_ram(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    words = ["plan", "--model", str(folder), "--gpu-memory", "80GB", "--host-memory", "512GiB", "--longest"]
    done = cli(*words)
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[1].split()
    assert header == ["RECIPE", "METHOD", "LONGEST", "RUNG", "GPU", "GiB", "HOST", "GiB", "ADD"]
    data = json.loads(cli(*words, "--json", "--method", "qlora", "lora.r=32").stdout)
    (qlora,) = data["estimates"]
    assert qlora["recipe"] == "qlora" and qlora["rung"] == "tiled MLP" and qlora["micro_batch"] == 1
    assert qlora["add"] == ["activation_offload=true", "lean_norms=true", "tiled_mlp=true"]
    assert qlora["seq_length"] == qlora["longest_seq_length"]
    r = load_recipe("qlora", ["lora.r=32", "per_device_train_batch_size=1", "activation_offload=true", "lean_norms=true",
                              "tiled_mlp=true"])
    at = estimate(r, structure(LLAMA_8B), Topology(1), seq_length=qlora["longest_seq_length"])
    assert at.total == qlora["total"] and at.total <= 80 * 10**9 < estimate(
        r, structure(LLAMA_8B), Topology(1), seq_length=qlora["longest_seq_length"] + 1024).total
    assert re.search(r"\nqlora +QLoRA +\d+K +tiled MLP +[\d.]+ +[\d.]+ +activation_offload=true lean_norms=true "
                     r"tiled_mlp=true\n",
                     done.stdout)


def test_at_128k_plan_recommends_a_lora_and_a_qlora_recipe_a_rung_up_where_needed(cli, tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    done = cli("plan", "--model", str(folder), "--gpu-memory", "80GB", "--host-memory", "512GiB",
               "max_seq_length=131072", "per_device_train_batch_size=1")
    assert done.returncode == 0, done.stderr
    assert "LoRA: single-gpu-lora+offload: the fastest recipe that fits" in done.stdout
    assert "QLoRA: qlora+offload: the fastest recipe that fits" in done.stdout and "nothing fits" not in done.stdout
    assert "single-gpu-lora+offload: fits with activation offload (activation_offload=true), not as written" in done.stdout
