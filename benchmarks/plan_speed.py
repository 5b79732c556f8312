"""How long `memrecipe plan` takes for a 70B-parameter config, against `memrecipe --help` (the
floor: Python and click start-up) measured in the same script.

    python benchmarks/plan_speed.py
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "num_hidden_layers": 80, "tie_word_embeddings": False}


def seconds(args, repeat=5):
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memrecipe", *args], check=True, capture_output=True)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main():
    folder = Path(tempfile.mkdtemp()) / "llama-70b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    base = seconds(["--help"])
    table = seconds(["plan", "--model", str(folder), "--num-processes", "8", "--gpu-memory", "80GB",
                     "--host-memory", "2TiB", "max_seq_length=4096", "per_device_train_batch_size=1"])
    batch = seconds(["plan", "--model", str(folder), "--num-processes", "8", "--gpu-memory", "80GB",
                     "--host-memory", "2TiB", "--global-batch", "512", "max_seq_length=4096"])
    print(f"memrecipe --help                          {base:.2f} s (baseline)")
    print(f"plan, 70B, all recipes                   {table:.2f} s  ({table / base:.1f}x baseline)")
    print(f"plan, 70B, all recipes, --global-batch   {batch:.2f} s  ({batch / base:.1f}x baseline)")


if __name__ == "__main__":
    main()
