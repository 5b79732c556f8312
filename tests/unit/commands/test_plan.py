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
    ([], "no GPU found here: give --gpu (e.g. H100) or --gpu-memory"),
    (["--recipe", "nope"], "unknown recipe 'nope'"),  # what is wrong with the input first, then the machine
    (["max_seq_lenght=4096"], "unknown key 'max_seq_lenght' (did you mean 'max_seq_length'?)"),
    (["--gpu-memory", "1GiB", "per_device_train_batch_size=64"], "nothing fits"),
    (["--gpu-memory", "24GiB", "lora.r=0"], "lora.r must be >= 1"),
    (["--gpu-memory", "24GiB", "--num-processes", "0"], "--num-processes must be >= 1, got 0"),
    (["--gpu", "B300"], "--gpu B300 is not in memrecipe's GPU table: one of H100, H100-PCIe"),
    (["--gpu", "H100", "--gpu-memory", "80GB"], "give --gpu H100 or --gpu-memory 80GB, not both"),
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
    fits = {e["recipe"].split("+")[0]: e["fits"] for e in data["estimates"]}  # (a row that fits nowhere: at its
    assert not fits["adamw-8bit"] and not fits["zero3-offload"]  # closest rung) 80 GB of GPU; 145 GB of offload in 64 GiB


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
    rows = {line.split()[0].split("+")[0]: line.split()[1:4] for line in done.stdout.splitlines()
            if line[:1] != " " and line.split()[:1] and line.split()[0].split("+")[0] in ("single-gpu-full",
                                                                                             "single-gpu-lora")}
    assert rows == {"single-gpu-full": ["8", "x", "2048"], "single-gpu-lora": ["4", "x", "2048"]}  # a real job's
    assert "host RAM 152.1 GiB per machine (not checked: give --host-memory)" in done.stdout  # zero3-offload's: 20 bytes
    # a parameter (fp32 master and moments, the flat 16-bit gradients and parameters, an fp32 gradient: docs/memory.md)
    small = cli("plan", "--cpu")  # the embedded model: its own rows of 256 tokens
    assert [line.split()[1:4] for line in small.stdout.splitlines() if line.startswith("single-gpu-lora ")] == \
        [["4", "x", "256"]]
    host = cli("plan", "--model", str(folder), "--gpu-memory", "24GB", "--host-memory", "64GiB", "--method", "full")
    assert host.returncode == 2 and "nothing fits in host RAM: the least is zero2 at 150.6 GiB per machine" in host.stderr
    # (20 bytes a parameter: DeepSpeed's estimator's 16, its 16-bit buffer and the 16-bit gradient accumulators)
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
    assert header == ["RECIPE", "METHOD", "LONGEST", "RUNG", "GPU", "GiB", "HOST", "GiB", "S/STEP", "ADD"]
    data = json.loads(cli(*words, "--json", "--method", "qlora", "lora.r=32").stdout)
    (qlora,) = data["estimates"]
    top = ["activation_offload=true", "lean_norms=true", "tiled_mlp=true", "attn_implementation=sdpa", "packing=false",
           "query_chunks=true"]
    assert qlora["recipe"] == "qlora" and qlora["rung"] == "query chunks" and qlora["micro_batch"] == 1
    assert qlora["add"] == top
    assert qlora["seq_length"] == qlora["longest_seq_length"]
    r = load_recipe("qlora", ["lora.r=32", "per_device_train_batch_size=1", *top])
    at = estimate(r, structure(LLAMA_8B), Topology(1), seq_length=qlora["longest_seq_length"])
    assert at.total == qlora["total"] and at.total <= 80 * 10**9 < estimate(
        r, structure(LLAMA_8B), Topology(1), seq_length=qlora["longest_seq_length"] + 1024).total
    assert re.search(r"\nqlora +QLoRA +\d+K +query chunks +[\d.]+ +[\d.]+ +[\d.,]+ +activation_offload=true "
                     r"lean_norms=true tiled_mlp=true attn_implementation=sdpa packing=false query_chunks=true\n",
                     done.stdout)
    # a step at that length, forecast on the GPU named (the reference H100 where only a size is given)
    assert qlora["forecast_on"] == "H100" and qlora["step_seconds"] > 0
    h200 = json.loads(cli("plan", "--model", str(folder), "--gpu", "H200", "--longest", "--json", "--method", "qlora",
                          "lora.r=32").stdout)["estimates"][0]
    assert h200["forecast_on"] == "H200" and h200["longest_seq_length"] > qlora["longest_seq_length"]


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


def eight_b(tmp_path):
    folder = tmp_path / "llama-8b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return str(folder)


def test_the_lora_pick_considers_full_recipes_given_a_lora_section_and_says_the_command(cli, tmp_path):
    """8 x 80 GB at 256K: no LoRA recipe fits, zero3-ulysses with a lora: section does (without the user having to know
    to type lora.r=16), and the pick is a whole command to copy; QLoRA has no multi-GPU long-context path: use LoRA."""
    model = eight_b(tmp_path)
    args = ["plan", "--model", model, "--num-processes", "8", "--gpu-memory", "80GB", "max_seq_length=262144"]
    data = json.loads(cli(*args, "--json").stdout)
    lora = data["recommendations"]["lora"]
    assert lora["recipe"].startswith("zero3-ulysses+lora"), lora
    assert lora["command"] == (f"memrecipe run sft --recipe zero3-ulysses --model {model} --num-processes 8 "
                               "max_seq_length=262144 lora.r=16 lora.target_modules=all-linear")
    assert "no multi-GPU long-context path takes QLoRA here" in data["recommendations"]["qlora"]["reason"]
    text = cli(*args).stdout
    assert f"\n    memrecipe run sft --recipe zero3-ulysses --model {model} --num-processes 8" in text
    assert all("rung" in e and "add" in e for e in data["estimates"])  # plain --json says each row's rung too
    one = json.loads(cli("plan", "--model", model, "--gpu-memory", "80GB", "--json", "max_seq_length=131072",
                         "per_device_train_batch_size=1").stdout)
    row = {e["recipe"]: e for e in one["estimates"]}["single-gpu-lora+offload"]
    assert (row["rung"], row["add"]) == ("activation offload", ["activation_offload=true"])
    assert one["recommendations"]["lora"]["command"].endswith("activation_offload=true")


def test_nothing_fits_quotes_the_closest_rung_at_micro_batch_1_and_only_advice_that_changes_something(cli, tmp_path):
    """24 GB at 64K: no recipe fits its micro batch of 4 x 65536, so the plan is made at micro batch 1 and says so;
    a row that fits no rung is shown at its closest (the top rung, not the recipe as written), and the refusal
    does not suggest per_device_train_batch_size=1 when it is 1 already."""
    model = eight_b(tmp_path)
    done = cli("plan", "--model", model, "--gpu-memory", "24GB", "--method", "lora", "max_seq_length=65536")
    assert "no recipe fits its own micro batch here: planned at micro batch 1" in done.stdout
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("single-gpu-lora"))
    assert row[0] == "single-gpu-lora+chunks" and row[1:4] == ["1", "x", "65536"] and float(row[8]) < 30
    assert "single-gpu-lora+chunks: does not fit on any rung; shown at its closest, query chunks" in done.stdout
    said = done.stdout + done.stderr
    assert "nothing fits on the GPUs: the least is single-gpu-lora+chunks" in said
    assert "per_device_train_batch_size=1" not in said.split("nothing fits on the GPUs")[1]


def test_longest_says_what_no_dropout_reaches_only_where_it_reaches_further_and_splits_only_over_processes(cli, tmp_path,
                                                                                                          monkeypatch):
    """The footer named lora.dropout=0 under every table, also where the lengths were equal; zero3-ulysses on one GPU
    stood on 'sequence parallelism' with nothing split (it climbs from the tiled MLP to query chunks there)."""
    model = eight_b(tmp_path)
    done = cli("plan", "--model", model, "--gpu-memory", "80GB", "--longest")
    assert "single-gpu-lora: lora.dropout=0 reaches" in done.stdout  # o_proj's redrawn dropout binds at 80 GB
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("zero3-ulysses"))
    assert "sequence" not in row and row[4:6] == ["query", "chunks"]
    from click.testing import CliRunner

    from memrecipe.commands import plan
    from memrecipe.planning.ladder import Longest

    real = plan.longest_per_recipe
    words = ["--model", model, "--gpu-memory", "24GB", "--longest", "--method", "lora",
             "attn_implementation=flash_attention_2"]
    out = CliRunner().invoke(plan.command, words)
    assert "lora.dropout=0" not in out.output  # the plan gives the same lengths with and without dropout here

    def further(recipe, *args):  # where no dropout reaches further, the line says how far
        row = real(recipe, *args)
        return Longest(row.recipe, row.rung, row.seq_length * 2, row.verdict) if recipe.lora and \
            recipe.lora.dropout == 0 and row.seq_length else row

    monkeypatch.setattr(plan, "longest_per_recipe", further)
    out = CliRunner().invoke(plan.command, words)
    assert "single-gpu-lora: lora.dropout=0 reaches 112K" in out.output, out.output  # (2 x 56K)


def test_a_gpu_named_is_planned_at_what_cuda_shows_of_it(cli):
    """--gpu H100: 79.2 GiB (CUDA's total_memory on the leased H100), not 80e9 bytes; said in the table and --json."""
    done = cli("plan", "--recipe", "single-gpu-lora", "--gpu", "h100")
    assert done.returncode == 0 and "79.2 GiB per GPU (H100, as CUDA shows it)" in done.stdout, done.stderr
    data = json.loads(cli("plan", "--recipe", "single-gpu-lora", "--gpu", "A100 40GB", "--json").stdout)
    assert (data["gpu"], data["gpu_memory"]) == ("A100-40GB", 40_960 * 2**20)


def test_plan_says_ncclS_share_of_each_rows_total_on_several_gpus(cli, tmp_path):
    """NCCL's buffers sit outside torch's allocator, in TOTAL: the table says each row's share under it and --json
    gives `nccl`; one GPU opens no communicator."""
    from memrecipe.planning.nccl import collectives_bytes, exchange_bytes

    model = eight_b(tmp_path)
    args = ["plan", "--model", model, "--gpu-memory", "80GB", "max_seq_length=65536"]
    eight = {e["recipe"]: e for e in json.loads(cli(*args, "--num-processes", "8", "--json").stdout)["estimates"]}
    assert eight["zero3-ulysses"]["nccl"] == 2 * collectives_bytes(8, 8) + exchange_bytes(8, 8)
    assert eight["ddp+norms"]["nccl"] == collectives_bytes(8, 8)  # (at 64K the climbed row)
    assert "NCCL's buffers in TOTAL, GiB a GPU" in cli(*args, "--num-processes", "8").stdout
    one = cli(*args, "--num-processes", "1")
    assert "NCCL" not in one.stdout
    assert all(e["nccl"] == 0 for e in json.loads(cli(*args, "--num-processes", "1", "--json").stdout)["estimates"])


def test_plan_says_where_auto_dropout_takes_the_redraw(cli, tmp_path):
    """`lora.redraw_dropout: auto` as `plan` decides it, row by row, at the rung each climbed to: peft's dropout at 2K
    tokens of an 8B on an 80 GB GPU (`redraws_dropout` false in --json), the redraw at 700K, where peft's masks do
    not fit (said under the table, with what peft's would need)."""
    from model_configs import model_folder

    folder = model_folder(tmp_path / "llama-8b", LLAMA_8B)
    for length, redraw in ((2048, False), (700 * 1024, True)):
        words = ["plan", "--recipe", "single-gpu-lora", "--model", str(folder), "--gpu-memory", "80GB",
                 "--host-memory", "1TiB", f"max_seq_length={length}", "per_device_train_batch_size=1"]
        (row,) = json.loads(cli(*words, "--json").stdout)["estimates"]
        assert row["fits"] and row["redraws_dropout"] is redraw, row
        text = cli(*words).stdout
        assert ("lora.redraw_dropout: auto redraws the adapters' dropout in backward for single-gpu-lora+MLP: with "
                "peft's" in text) is redraw, text


def test_a_kernel_the_model_has_no_path_for_is_refused_with_why_not_what_is_short(cli, tmp_path):
    """Gemma 2 under attn_implementation=sdpa, which its transformers class refuses at load (a traceback in the
    run's process before): plan marks the row refused, not short of memory on any rung, and says why in one line;
    run refuses it before anything is written. auto plans a kernel it has."""
    from unit.planning.test_attention import windowed_model

    folder = windowed_model(tmp_path, "gemma2", head_dim=32, sliding_window=256)
    named = cli("plan", "--model", folder, "--gpu", "H100", "--recipe", "single-gpu-lora", "attn_implementation=sdpa")
    row = next(line for line in named.stdout.splitlines() if line.startswith("single-gpu-lora"))
    assert row.split()[0] == "single-gpu-lora" and " refused " in row  # the recipe as written: no rung helps
    why = "transformers has no sdpa path for gemma2 (its class refuses it at load): use attn_implementation="
    assert named.returncode == 2 and f"nothing can run: single-gpu-lora: attention: {why}" in named.stderr
    run = cli("run", "sft", "--recipe", "single-gpu-lora", "--model", folder, "--output-dir", str(tmp_path / "r"),
              "attn_implementation=sdpa")
    assert run.returncode == 2 and why in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "r").exists()
    auto = cli("plan", "--model", folder, "--gpu", "H100", "--recipe", "single-gpu-lora")
    assert auto.returncode == 0 and "attention: flex_attention" in auto.stdout, auto.stdout[-800:]
