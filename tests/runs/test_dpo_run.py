"""`memrecipe run dpo` end to end on CPU: the embedded preference set trains (reward accuracy, margins); 2 DDP
processes with a precomputed reference, killed and resumed, 2 FSDP-LoRA processes with the adapters off as the
reference, and a ZeRO-3 full fine-tune against its precomputed reference each train as one process; the run
folder, log, report and card say it was DPO.

One uninterrupted run (the README's DPO command, in fp32 with a checkpoint half-way) serves every test."""

import json
from pathlib import Path

import pytest
import torch

from helpers import SideBySide, finish, start, stop_at_a_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXACT = ["mixed_precision=no", "lora.dropout=0", "save_steps=6"]  # fp32 and no dropout: runs compare exactly
SHIPPED = EXACT[1:]  # the recipes' own precision (bf16 on CPU), where no other run is compared step by step


def history(report, key):
    return [h[key] for h in report["history"]]


SAME = ["mixed_precision=no", "max_steps=8", "eval_steps=null", "gradient_checkpointing=true"]  # full fine-tunes
FROZEN = "dpo.precompute_ref_log_probs=false"
TWO = ["--num-processes", "2", "gradient_accumulation_steps=2"]


# the recipes no other test here launches: 2 steps each (their objective is the one tested above; what differs is
# the engine, the 4-bit base, the 8-bit optimizer)
OTHERS = {"qlora": [], "zero2": ["--num-processes", "2"], "adamw-8bit": ["--num-processes", "1"],
          "fsdp-lora": ["--num-processes", "2"]}  # (all in bf16: FSDP2 + LoRA with the adapters off once crashed there)
SMOKE = ["max_steps=2", "eval_steps=null", "gradient_accumulation_steps=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launch of this module, two at a time (a launch is mostly start-up, one core's work; a one-process run is
    pinned to its slot's core): `runs(name)` waits for one and gives its folder. The README's DPO run ("whole", in
    fp32 with a checkpoint half-way) is the one-process reference of the LoRA runs; "one" that of the full ones."""
    base = tmp_path_factory.mktemp("dpo")

    def run(name, words, core=None):
        finish(start(words, base / name, core=core, script="dpo"))
        return base / name

    def killed_and_resumed(core):
        ddp = base / "ddp"
        words = ["--recipe", "single-gpu-lora", "--num-processes", "2", "distributed_type=ddp",
                 "supports.max_processes=null", "gradient_accumulation_steps=2", "dpo.precompute_ref_log_probs=true",
                 *EXACT]
        killed_at = stop_at_a_checkpoint(start(words, ddp, script="dpo"), ddp)
        (base / "ddp.killed.log").write_text((base / "ddp.log").read_text())
        finished = (ddp / "final").exists()
        return ddp, killed_at, finished, run("ddp", ["--resume"])

    jobs = SideBySide({
        "whole": lambda core: run("whole", ["--recipe", "single-gpu-lora", *EXACT], core),
        "fsdp": lambda core: run("fsdp", ["--recipe", "fsdp-lora", "--num-processes", "2", *EXACT]),
        "simpo": lambda core: run("simpo", ["--recipe", "single-gpu-lora", "dpo.loss_type=simpo", "dpo.beta=2.0",
                                            "eval_steps=null"], core),
        "on": lambda core: run("on", ["--recipe", "fsdp-lora", "--num-processes", "2", "--model",  # a saved adapter,
                                      str(jobs("whole") / "final"), "eval_steps=null", *SHIPPED]),  # in bf16
        "ddp": killed_and_resumed,
        "zero3": lambda core: run("zero3", ["--recipe", "zero3-offload", *TWO, *SAME]),
        "copy3": lambda core: run("copy3", ["--recipe", "zero3-offload", *TWO, FROZEN, *SAME]),
        "fsdp-copy": lambda core: run("fsdp-copy", ["--recipe", "fsdp", *TWO, FROZEN, *SAME[:-1]]),  # (its own
        # fsdp.activation_checkpointing)
        "one": lambda core: run("one", ["--recipe", "ddp", "--num-processes", "1", "gradient_accumulation_steps=4",
                                        FROZEN, *SAME], core),
        **{name: (lambda core, name=name, words=words: run(name, ["--recipe", name, *words, *SMOKE],
                                                            None if "2" in words else core))  # (1 process: pinned)
           for name, words in OTHERS.items()}})
    yield jobs
    jobs.close()


def report_of(folder):
    return json.loads((folder / "report.json").read_text())


@pytest.fixture(scope="module")
def whole(runs):
    folder = runs("whole")
    return folder, report_of(folder)


def test_the_embedded_preferences_train(whole):
    folder, report = whole
    history = report["history"]
    quarter = max(1, len(history) // 4)
    last = history[-quarter:]
    assert len(history) >= 8 and history[0]["rewards/accuracies"] == 0  # policy = reference at step 1: no margin
    assert sum(h["rewards/accuracies"] for h in last) / quarter >= 0.8, [h["rewards/accuracies"] for h in history]
    first_margins = sum(h["rewards/margins"] for h in history[:quarter]) / quarter
    assert sum(h["rewards/margins"] for h in last) / quarter > first_margins + 0.2
    assert history[-1]["loss"] < 0.9 * history[0]["loss"]  # (ln 2 at step 1)
    assert all(h["pairs"] > 0 and 0 < h["targets"] < h["tokens"] for h in history)  # prompts are no targets
    metrics = report["final_eval_metrics"]
    assert set(metrics) == {f"eval_{m}" for m in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                  "rewards/margins", "logps/chosen", "logps/rejected")}
    assert report["recipe"]["dpo"]["loss_type"] == "sigmoid"  # TRL's defaults, written into the run's recipe


def test_the_log_folder_and_card_say_it_is_dpo(whole):
    from memrecipe.report import card

    folder, report = whole
    log = (folder.parent / "whole.log").read_text()
    assert "memrecipe dpo: recipe single-gpu-lora" in log and "dpo: 1 x sigmoid, beta 0.1" in log
    assert "data: train: 304 pairs kept" in log
    assert "Continue it: memrecipe run dpo --resume" in (folder / "accelerate_config.yaml").read_text()
    assert any(line.startswith("preferences: rewards/accuracies 0.000 -> ") for line in card(report).splitlines())


def test_the_trained_adapter_reloads_and_prefers_the_chosen_answers(whole):
    """The saved adapter is the trained one: on the training pairs it gives the chosen completions a higher
    log-probability margin over the rejected than the base does (what the last step's metrics say)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memrecipe.planning.registry import EMBEDDED_PREFERENCES
    from memrecipe.training.preference import PairCollator, pack_pairs, sequence_logps, tokenize_pair

    folder, report = whole
    base_path = json.loads((folder / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    tokenizer = AutoTokenizer.from_pretrained(folder / "final")
    rows = [json.loads(line) for line in open(EMBEDDED_PREFERENCES)][:32]
    from datasets import Dataset

    batch = PairCollator(tokenizer.pad_token_id)(list(pack_pairs(Dataset.from_list(
        [tokenize_pair(r, tokenizer, 128) for r in rows]), 256)))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                                      folder / "final").eval()
    with torch.no_grad():
        trained = sequence_logps(model, batch).view(-1, 2)
        with model.disable_adapter():
            base = sequence_logps(model, batch).view(-1, 2)
    margins = (trained[:, 0] - base[:, 0]) - (trained[:, 1] - base[:, 1])
    assert (margins > 0).float().mean() >= 0.75, margins


def test_two_ddp_processes_with_a_precomputed_reference_killed_and_resumed_train_as_one(whole, runs):
    """The same global batch (4 rows x 2 micro batches x 2 processes = 4 x 4 x 1), pairs falling unevenly into rows
    and processes, the reference's log-probs precomputed (each process a share of the rows, gathered) instead of
    computed beside each step. SIGKILLed at its checkpoint and resumed, the run reads its stored reference instead
    of computing it again: every step's loss (a mean over the window's pairs) and metrics equal the uninterrupted
    one-process run's (the README's command)."""
    folder, report = whole
    ddp, killed_at, finished_when_killed, _ = runs("ddp")
    assert "reference: 338 pairs' log-probs computed in" in (ddp.parent / "ddp.killed.log").read_text()
    store = torch.load(ddp / "reference_logps.pt", weights_only=True)["logps"]
    assert store.shape == (338, 2) and bool((store < 0).all())  # every train and eval pair, log-probabilities
    assert killed_at == 6 and not finished_when_killed
    resumed = report_of(ddp)
    log = (ddp.parent / "ddp.log").read_text()
    assert "resumed from checkpoints/step-6" in log and "taken over" in log  # the killed run's lock was stale
    assert "reference: 338 pairs' log-probs read from reference_logps.pt" in log
    assert resumed["setup"]["num_processes"] == 2
    # (the store's batches differ from each step's: 1e-4; not the accuracy, which counts margins > 0 while policy =
    # reference)
    for key in ("loss", "lr", "pairs", "rewards/margins", "rewards/chosen", "logps/rejected"):
        assert history(resumed, key) == pytest.approx(history(report, key), abs=1e-4), key


def test_fsdp_lora_with_the_adapters_off_as_reference_trains_as_one_process(whole, runs):
    """FSDP2 over 2 processes, the reference its sharded base with the adapters off beside each micro batch: the
    same global batch's steps equal the one-process run's."""
    folder, report = whole
    fsdp = report_of(runs("fsdp"))
    assert fsdp["setup"]["distributed_type"] == "FSDP" and "the base with the adapters off" in \
        (folder.parent / "fsdp.log").read_text()
    for key in ("loss", "lr", "pairs", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert history(fsdp, key) == pytest.approx(history(report, key), abs=1e-5), key
    assert fsdp["final_eval_metrics"] == pytest.approx(report["final_eval_metrics"], abs=1e-5)


def test_full_fine_tunes_with_a_precomputed_reference_or_a_frozen_copy_train_as_one_process(runs):
    """No LoRA: the reference is the initial model's log-probs, precomputed (no frozen copy held beside it) under
    DeepSpeed ZeRO-3 with offload on 2 processes (the store's forward passes gather the partitioned weights), or,
    with dpo.precompute_ref_log_probs false, a frozen copy of the initial model beside the policy: partitioned like
    it on 2 ZeRO-3 processes (an engine of its own), sharded like it on 2 FSDP2 processes, whole on one plain process.
    All four take the same steps, and the model learns to prefer the chosen answers; the copy's bytes are held, and
    planned, beside the policy's."""
    zero3, copy3, fsdp, one = (runs(name) for name in ("zero3", "copy3", "fsdp-copy", "one"))
    logs = zero3.parent
    sharded, partitioned, copied, plain = (json.loads((f / "report.json").read_text()) for f in (zero3, copy3, fsdp, one))
    assert sharded["setup"]["distributed_type"] == partitioned["setup"]["distributed_type"] == "DEEPSPEED"
    assert copied["setup"]["distributed_type"] == "FSDP" and copied["setup"]["num_processes"] == 2
    assert "reference: its log-probs precomputed before the first step" in (logs / "zero3.log").read_text()
    for log in ("copy3.log", "fsdp-copy.log", "one.log"):
        assert "reference: a frozen copy of the initial model, beside each micro batch" in (logs / log).read_text()
    assert not any((f / "reference_logps.pt").exists() for f in (copy3, fsdp, one))
    assert plain["setup"]["trainable_params"] == plain["setup"]["params"]
    for key in ("loss", "pairs", "rewards/margins", "logps/chosen", "logps/rejected"):
        for other in (sharded, partitioned, copied):
            assert history(other, key) == pytest.approx(history(plain, key), abs=1e-4), key
    first, last = plain["history"][0], plain["history"][-1]
    assert last["rewards/accuracies"] > 0.6 and last["rewards/margins"] > first["rewards/margins"] + 0.2
    assert last["loss"] < 0.9 * first["loss"]
    # the copy: a second model's fp32 weights, whole on one process, half of them on each FSDP process
    weights = 4 * plain["setup"]["params"]
    assert plain["processes"][0]["held"]["parameters"] == plain["plan"]["parameters"] == 2 * weights
    assert all(p["held"]["parameters"] == pytest.approx(weights, rel=0.01) for p in copied["processes"] +
               partitioned["processes"])


@pytest.mark.parametrize("name", OTHERS)
def test_every_other_recipe_runs_dpo(runs, name):
    """run dpo on the recipes the tests above do not launch, in the precision they ship (bf16 here): QLoRA and FSDP2 +
    LoRA on 2 processes (the base with the adapters off is the reference), ZeRO-2 and adamw-8bit (full fine-tunes
    against their precomputed store)."""
    folder = runs(name)
    report, log = report_of(folder), (folder.parent / f"{name}.log").read_text()
    assert report["recipe"]["name"] == name and [h["step"] for h in report["history"]] == [1, 2]
    assert report["setup"]["mixed_precision"] == "bf16"
    assert all(h["pairs"] > 0 and 0.3 < h["loss"] < 1.2 and "rewards/margins" in h for h in report["history"])
    full = name not in ("qlora", "fsdp-lora")
    assert ("reference: its log-probs precomputed" if full else "reference: the base with the adapters off") in log
    assert (folder / "reference_logps.pt").exists() == full and (folder / "final").is_dir()


@pytest.mark.parametrize("words, says", [
    (["--recipe", "single-gpu-lora", "lora.init_lora_weights=pissa"], "rewrites the base"),
    (["--recipe", "tp"], "run dpo does not run tensor parallelism"),
    (["--recipe", "zero3-ulysses"], "run dpo does not run sequence parallelism in this release (a pair's log-probs"),
    (["--recipe", "single-gpu-lora", "dpo.max_length=200"], "dpo.max_length=200 lets a pair's two sequences fill 400")])
def test_what_run_dpo_does_not_run_yet_is_refused_in_one_line(cli, tmp_path, words, says):
    out = cli("run", "dpo", "--output-dir", str(tmp_path / "run"), *words)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_bad_preference_data_is_one_line_and_writes_nothing(cli, tmp_path):
    rows = [{"prompt": "Hi", "chosen": " a.", "rejected": " b."}, {"prompt": "Yo", "chosen": " c."}]
    (tmp_path / "missing.jsonl").write_text("\n".join(json.dumps(r) for r in rows))  # its second row: no rejected
    (tmp_path / "same.jsonl").write_text("\n".join(json.dumps({"prompt": "Hi", "chosen": " a.", "rejected": " a."})
                                                   for _ in range(3)))
    for name, says in (("missing", "row 2 has no rejected"), ("same", "chosen equals rejected in every row")):
        out = cli("run", "dpo", "--recipe", "single-gpu-lora", "--dataset", str(tmp_path / f"{name}.jsonl"),
                  "--output-dir", str(tmp_path / name))
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert not Path(tmp_path / name).exists()


def test_simpo_trains_with_no_reference_at_all(runs):
    """SimPO is reference-free: no reference pass runs, no store is computed or written; the rewards (beta x the
    mean log-prob per completion token) separate the chosen from the rejected."""
    simpo = runs("simpo")
    report = report_of(simpo)
    assert "reference: none (a reference-free objective" in (simpo.parent / "simpo.log").read_text()
    assert not (simpo / "reference_logps.pt").exists()
    first, last = report["history"][0], report["history"][-1]
    assert last["rewards/margins"] > first["rewards/margins"] + 0.2 and last["loss"] < 0.9 * first["loss"]
    assert -20 < last["logps/chosen"] < 0  # per token, as TRL's CPO reports it


def test_dpo_on_a_saved_adapter_trains_it_on_against_its_frozen_copy(whole, runs, cli, tmp_path):
    """DPO on top of an SFT adapter (`--model runs/<sft>/final`, TRL's ref_adapter_name case; here the README run's
    adapter stands for the SFT one), on 2 FSDP2 processes: the policy starts from the adapter and the reference is
    that adapter frozen (switched to with peft's set_adapter on the sharded model; one process: test_preference), so
    step 1 has no margin at all (with the adapters off as the reference it would: the adapter already prefers) and
    logps/chosen is the adapter's, not the base's; the saved adapter is the one that trained, with the start's shape,
    for the original base, without the frozen copy. A full fine-tune cannot start from an adapter: one line."""
    from safetensors.torch import load_file

    folder, report = whole
    start_adapter = folder / "final"
    on = runs("on")
    trained = report_of(on)
    log = (on.parent / "on.log").read_text()
    assert f"lora: trains on the saved adapter {start_adapter}" in log
    assert "reference: the saved adapter's frozen copy" in log
    first = trained["history"][0]
    assert trained["setup"]["mixed_precision"] == "bf16"  # the recipe's own precision
    assert abs(first["rewards/margins"]) < 1e-6 and abs(first["rewards/chosen"]) < 1e-6  # policy = reference
    # the start is the trained adapter: its log-probs are the README run's last ones, not the base's first
    assert abs(first["logps/chosen"] - report["history"][0]["logps/chosen"]) > 1
    last = trained["history"][-3:]  # and it trains on from there
    assert sum(h["rewards/margins"] for h in last) / 3 > 0.2 and sum(h["rewards/accuracies"] for h in last) / 3 >= 0.8
    start_config = json.loads((start_adapter / "adapter_config.json").read_text())
    config = json.loads((on / "final" / "adapter_config.json").read_text())
    assert (config["r"], sorted(config["target_modules"]), config["base_model_name_or_path"]) == \
        (start_config["r"], sorted(start_config["target_modules"]), start_config["base_model_name_or_path"])
    # the frozen copy: as many parameters again as train, held (sharded, fp32) and planned beside the model; not saved
    assert trained["setup"]["params"] == report["setup"]["params"] + trained["setup"]["trainable_params"]
    adapters = trained["setup"]["trainable_params"]  # (and as many in the copy, both fp32; the base bf16, as shipped)
    sharded = (2 * (trained["setup"]["params"] - 2 * adapters) + 4 * 2 * adapters) / 2
    assert all(p["held"]["parameters"] == pytest.approx(sharded, rel=0.01) for p in trained["processes"])
    assert any(note.startswith("the reference: the saved adapter's frozen copy") for note in trained["plan"]["notes"])
    assert not (on / "final" / "reference").exists()
    before, after = load_file(start_adapter / "adapter_model.safetensors"), load_file(on / "final" / "adapter_model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    for command in (["run", "dpo", "--recipe", "adamw-8bit", "--output-dir", str(tmp_path / "full")],
                    ["plan", "--recipe", "single-gpu-full", "--cpu"]):
        out = cli(*command, "--model", str(start_adapter))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"{start_adapter} is a LoRA adapter, and this recipe fine-tunes a whole model: memrecipe export " \
               f"{folder} {folder}-merged --merge, then --model {folder}-merged" in out.stderr
    assert not (tmp_path / "full").exists()
