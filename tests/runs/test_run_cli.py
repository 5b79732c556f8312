"""`memrecipe run`: the README's main job, the run folder, dry runs, and errors before any folder exists."""

import json

import pytest

from helpers import REPO, child_env, launch, pin, wait_for
from model_configs import stub_weights


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_job_learns_and_runs_twice_into_two_folders(tmp_path):
    """`memrecipe run sft --recipe single-gpu-lora`, exactly as the README has it, from a fresh folder; a second run,
    started beside it once the first has made its folder, gets a folder of its own."""
    import subprocess
    import sys

    said = tmp_path / "first.log"
    first = subprocess.Popen([sys.executable, "-m", "memrecipe", "run", "sft", "--recipe", "single-gpu-lora"],
                             cwd=tmp_path, env=child_env(), stdout=open(said, "w"), stderr=subprocess.STDOUT,
                             preexec_fn=pin(0))
    wait_for(lambda: (tmp_path / "runs").is_dir() and any((tmp_path / "runs").iterdir()), first)
    # again, where matplotlib is broken or removed (it is a dependency): the run still works and says what to install
    hide = tmp_path / "no-plots"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    again = launch(["memrecipe", "run", "sft", "--recipe", "single-gpu-lora", "max_steps=2"], cwd=tmp_path,
                   env=child_env(PYTHONPATH=f"{hide}:{REPO / 'tests'}"), preexec_fn=pin(1))
    assert first.wait(timeout=600) == 0, said.read_text()[-3000:]
    assert "CPU smoke-test mode" in said.read_text()
    assert again.returncode == 0, again.stderr[-3000:]
    runs = sorted((tmp_path / "runs").iterdir())  # (a second folder made in the same second is named ...-2)
    assert len(runs) == 2 and (runs[0] / "loss.png").is_file() and not (runs[1] / "loss.png").exists()
    assert "no loss.png: matplotlib is missing, pip install matplotlib" in again.stdout + again.stderr
    first = runs[0]
    assert first.name.startswith("single-gpu-lora-")
    r = json.loads((first / "report.json").read_text())
    losses = [h["loss"] for h in r["history"]]
    # a visible fall, 6.8 -> 4.5 on the shipped data: 3 epochs packed into 6 steps of 16 rows of 256 tokens
    assert losses[-1] < 0.75 * losses[0] and losses[0] - losses[-1] > 1 and r["final_eval_loss"] < 0.8 * losses[0]
    # the recipe's numbers are a real model's; the embedded one trains at its own, and the start-up says so
    assert "model: memrecipe's embedded tiny Llama (random weights), at its own settings: learning_rate 0.005, " \
           "max_seq_length 256, 3 epochs" in said.read_text() and r["setup"]["embedded_model"]
    assert r["throughput"]["padding_fraction"] < 0.1  # packed rows, nearly full
    assert {p.name for p in first.iterdir()} >= {"accelerate_config.yaml", "final", "recipe.yaml", "report.json",
                                                 "train.log", "loss.png"}


def _bad_runs(tmp_path):
    no_columns = tmp_path / "qa.jsonl"
    no_columns.write_text('{"question": "a?", "answer": "b"}\n')
    remote = tmp_path / "remote-model"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "my-own-arch", "auto_map": {
        "AutoConfig": "configuration_mine.MyConfig", "AutoModelForCausalLM": "modeling_mine.MyModel"}}))
    not_causal = tmp_path / "vit"
    not_causal.mkdir()
    (not_causal / "config.json").write_text(json.dumps({"model_type": "vit"}))
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()  # a Llama config and nothing else: the tokenizer would fail only after launch
    (no_tokenizer / "config.json").write_text((REPO / "cli" / "memrecipe" / "data" / "tiny-llama" / "config.json").read_text())
    no_template = tmp_path / "no-template"  # a base model: its tokenizer has no chat template, the data is chat
    no_template.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_template / name).write_text((REPO / "cli" / "memrecipe" / "data" / "tiny-llama" / name).read_text())
    for folder in (remote, not_causal, no_tokenizer, no_template):  # (their weights pass: what is checked is later)
        stub_weights(folder)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    long = tmp_path / "long.jsonl"  # every prompt longer than max_seq_length=64: nothing would be left to learn
    long.write_text("".join(json.dumps({"prompt": " ".join(f"word{i}" for i in range(400)), "completion": " yes"})
                            + "\n" for _ in range(20)))
    return [
        (["--model", "someone/not-on-this-machine"], "neither a local folder nor reachable on the hub", None),
        (["--model", "./no/such/model"], "model_name_or_path: ./no/such/model does not exist", None),
        (["--model", str(remote)], "trust_remote_code=true", None),
        (["--model", str(not_causal)], "not a causal language model", None),
        (["--model", str(no_tokenizer)], "has no tokenizer memrecipe can load", None),
        (["--model", str(no_template)], "no chat template: set chat_template to a Jinja file", None),
        (["chat_template=nowhere.jinja"], "chat_template: nowhere.jinja does not exist", None),
        (["--dataset", str(no_columns)], "it has: question, answer", None),
        (["--dataset", str(tmp_path / "missing.jsonl")], "does not exist", None),
        (["--num-processes", "4", "--recipe", "fsdp"], "(to prepare a GPU run from here: memrecipe config fsdp --num-processes 4", None),
        (["--recipe", "single-gpu-lora", "--num-processes", "2"], "at most 1 process", None),
        (["--recipe", "qlora", "--num-processes", "2"], "use fsdp-qlora, fsdp-lora (LoRA) or", None),  # same way first
        (["--dataset", str(long), "max_seq_length=64"],
         "none of its 20 examples has a target token within max_seq_length=64", None),
        (["learning_rate=fast"], "learning_rate must be a number", None),
        ([], "is not empty: pass --overwrite", existing),
    ]


@pytest.mark.slow
def test_bad_runs_are_refused_in_one_line_before_any_folder_exists(tmp_path, capsys):
    """In this process (main() as the memrecipe command runs it): each refusal is what a user's terminal shows."""
    from memrecipe.main import main

    for args, words, folder in _bad_runs(tmp_path):
        out = folder or tmp_path / "never"
        recipe = [] if "--recipe" in args else ["--recipe", "single-gpu-lora"]
        with pytest.raises(SystemExit) as done:
            main(["run", "sft", *recipe, "--output-dir", str(out), *args])
        stderr = capsys.readouterr().err
        lines = stderr.strip().splitlines()
        assert done.value.code == 2, (args, stderr[-2000:])
        assert len(lines) == 1 and words in lines[0], (args, stderr[-2000:])
        if folder is None:
            assert not out.exists(), args
    assert (tmp_path / "existing" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_users_recipe_on_a_base_trains_on_a_mixture_and_its_pissa_adapter_exports(tmp_path):
    """A short recipe file starting from a shipped one, mixing an alpaca-style JSONL (columns mapped) with
    a chat parquet: it trains, the log counts what each source gave, and the run folder keeps it resolved.
    Its PiSSA adapter, converted at the end, merges onto the original base into the trained model: the
    same logits as the last checkpoint's adapter on the base decomposed again."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from memrecipe.training.loading import embedded_model
    from unit.training.test_data import mixture_files

    mixture_files(tmp_path)
    (tmp_path / "my.yaml").write_text(
        "base: single-gpu-lora\n"
        "dataset:\n"
        "  - {path: alpaca.jsonl, fraction: 0.7, columns: {prompt: \"{instruction}\\n{input}\", completion: output}}\n"
        "  - {path: chat.parquet, fraction: 0.3}\n"
        "max_steps: 3\n"
        "save_steps: 3\n"
        "packing: false\n"
        "gradient_accumulation_steps: 1\n"
        "mixed_precision: 'no'            # an fp32 base: the converted adapter is exact to float rounding\n"
        "lora: {init_lora_weights: pissa}\n")
    done = launch(["memrecipe", "run", "sft", "--recipe", "my.yaml", "--output-dir", "R", "eval_size=0"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "R" / "train.log").read_text()
    assert "train source " in log and "14 of 20 rows (fraction 0.7)" in log and "3 of 10 rows (fraction 0.3)" in log
    report = json.loads((tmp_path / "R" / "report.json").read_text())
    assert len(report["history"]) == 3 and all(h["targets"] > 0 for h in report["history"])
    stored = yaml.safe_load((tmp_path / "R" / "recipe.yaml").read_text())
    assert stored["name"] == "my" and "base" not in stored and stored["lora"]["r"] == 16
    assert [entry["path"] for entry in stored["dataset"]] == [str(tmp_path / "alpaca.jsonl"), str(tmp_path / "chat.parquet")]

    assert json.loads((tmp_path / "R" / "final" / "adapter_config.json").read_text())["r"] == 32  # [A | A0]
    with ThreadPoolExecutor(2) as pool:  # (side by side)
        for exported in pool.map(lambda words: launch(["memrecipe", "export", "R", *words], cwd=tmp_path),
                                 (["merged", "--merge"], ["from-checkpoint", "--merge", "--checkpoint", "step-3"])):
            assert exported.returncode == 0, exported.stderr[-2000:]
    probe = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged, resumed, before = (AutoModelForCausalLM.from_pretrained(path)(input_ids=probe).logits
                                   for path in (tmp_path / "merged", tmp_path / "from-checkpoint", embedded_model()))
    assert (merged - before).abs().max() > 1e-2  # trained
    torch.testing.assert_close(merged, resumed, atol=1e-4, rtol=0)


@pytest.mark.slow  # launches training
@pytest.mark.timeout(600)
def test_a_failure_after_launch_is_one_line_and_the_fixed_command_reuses_the_folder(tmp_path):
    """A dataset too small for one window fails inside the loop: its one line, exit 2, no launcher traceback;
    the folder (no checkpoint, no final save) takes the same command again once the problem is fixed."""
    from concurrent.futures import ThreadPoolExecutor

    from memrecipe.planning.registry import EMBEDDED_DATASET

    two = tmp_path / "two.jsonl"
    two.write_text("".join(EMBEDDED_DATASET.read_text().splitlines(keepends=True)[:2]))
    run = ["memrecipe", "run", "sft", "--recipe", "single-gpu-lora", "--dataset", str(two), "--output-dir", "R",
           "eval_size=0", "max_steps=2"]
    unnamed = tmp_path / "unnamed"  # the folder memrecipe named (runs/<recipe>-<time>) goes with the failed start
    unnamed.mkdir()
    beside = ThreadPoolExecutor(1).submit(launch, [word for word in run if word not in ("--output-dir", "R")],
                                          cwd=unnamed, preexec_fn=pin(1))
    failed = launch(run, cwd=tmp_path, preexec_fn=pin(0))
    said = failed.stdout + failed.stderr
    assert failed.returncode == 2, said[-3000:]
    assert said.count("memrecipe: error: the dataset gives") == 1 and "fewer than gradient_accumulation_steps" in said
    assert "Traceback" not in said and "CalledProcessError" not in said
    assert "Traceback" not in (tmp_path / "R" / "train.log").read_text()
    fixed = launch([*run, "gradient_accumulation_steps=1", "per_device_train_batch_size=1"], cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert (tmp_path / "R" / "final").is_dir()
    again = launch(run, cwd=tmp_path)  # a finished run keeps its protection
    assert again.returncode == 2 and "is not empty" in again.stderr
    failed = beside.result()
    assert failed.returncode == 2 and "fewer than gradient_accumulation_steps" in failed.stdout + failed.stderr
    assert not list(unnamed.glob("runs/*")), list(unnamed.rglob("*"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_data_people_have_trains_as_it_is(tmp_path):
    """A ShareGPT file (`conversations` of human / gpt turns) trains SFT with no mapping and through
    `columns: {messages: conversations}` (both sources of one run); an UltraFeedback-shaped file (a text prompt,
    chosen and rejected as whole conversations repeating it) trains DPO. Each 2 steps, side by side; that they
    tokenize as the messages / explicit-prompt forms do is test_data's and test_preference's."""
    from helpers import finish, start
    from memrecipe.planning.registry import EMBEDDED_DATASET

    chats = [json.loads(line) for line in EMBEDDED_DATASET.read_text().splitlines()[:64]]
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    (tmp_path / "sharegpt.jsonl").write_text("\n".join(json.dumps(
        {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c["messages"]]}) for c in chats))
    (tmp_path / "mine.yaml").write_text("base: single-gpu-lora\ndataset:\n  - {path: sharegpt.jsonl}\n"
                                        "  - {path: sharegpt.jsonl, columns: {messages: conversations}}\n")
    pairs = [{"prompt": c["messages"][0]["content"], "chosen": c["messages"][:2],
              "rejected": [c["messages"][0], {"role": "assistant", "content": "No idea."}]}
             for c in chats if len(c["messages"]) >= 2 and c["messages"][0]["role"] == "user"]
    (tmp_path / "ultrafeedback.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    short = ["max_steps=2", "eval_size=0", "gradient_accumulation_steps=1"]
    sft = start(["--recipe", str(tmp_path / "mine.yaml"), *short], tmp_path / "sharegpt", core=0)
    dpo = start(["--recipe", "single-gpu-lora", "--dataset", str(tmp_path / "ultrafeedback.jsonl"), *short],
                tmp_path / "ultrafeedback", core=1, script="dpo")
    finish(sft, dpo)
    for name in ("sharegpt", "ultrafeedback"):
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert [h["step"] for h in report["history"]] == [1, 2] and all(h["targets"] > 0 for h in report["history"])
    sources = [line for line in (tmp_path / "sharegpt.log").read_text().splitlines() if "data: train source" in line]
    assert len(sources) == 2 and all(": messages, 64 of 64 rows" in line for line in sources), sources
    assert f"data: train: {len(pairs):,} pairs kept" in (tmp_path / "ultrafeedback.log").read_text()
