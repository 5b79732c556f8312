"""benchmarks/snapshot_peak.py: what the CUDA allocator held at its peak, read off the allocator history the loop
writes on a GPU (a synthetic history here, in the format torch.cuda.memory._snapshot() gives)."""

import importlib.util
import pickle
import subprocess
import sys

from helpers import REPO

MiB = 2**20


def snapshot_peak():
    spec = importlib.util.spec_from_file_location("snapshot_peak", REPO / "benchmarks" / "snapshot_peak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


LOSS = frames(("/site/memrecipe/training/loss.py", 181, "backward"), ("/site/torch/autograd/function.py", 300, "apply"))
LIB = frames(("/site/transformers/models/llama/modeling_llama.py", 90, "forward"))
STEP = frames(("/repo/recipes/sft.py", 120, "train"))


def history():
    """a (100 MiB, the loss) is freed on request before b's peak but completes only after c: the allocator counts it
    until free_completed. The peak (200 MiB) is after d: b, c and d live."""
    events = [("alloc", 1, 100, LOSS), ("alloc", 2, 50, LIB), ("alloc", 3, 30, LOSS), ("free_requested", 1, 100, LOSS),
              ("free_completed", 1, 100, LOSS), ("alloc", 4, 120, STEP), ("free_completed", 2, 50, LIB),
              ("alloc", 5, 10, [])]
    return {"segments": [], "device_traces": [[{"action": a, "addr": addr, "size": size * MiB, "frames": f}
                                               for a, addr, size, f in events]]}


def test_the_peak_lists_the_blocks_live_at_it_and_the_code_that_made_them(tmp_path):
    top, blocks, start = snapshot_peak().peak(history()["device_traces"][0])
    assert top == 200 * MiB and start == 0
    assert blocks == [(120 * MiB, "recipes/sft.py:120 train"), (50 * MiB, "llama/modeling_llama.py:90 forward"),
                      (30 * MiB, "training/loss.py:181 backward")]  # the project's frame, not torch's below it
    path = tmp_path / "memory_snapshot_rank0.pickle"
    path.write_bytes(pickle.dumps(history()))
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "snapshot_peak.py"), str(path), "--top", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert ("device 0: peak 0.195 GiB allocated (above the history's start: the snapshot lists no live blocks; 8 events, "
            "3 blocks live at the peak)") in out
    assert "     120.0 MiB  recipes/sft.py:120 train" in out and "30.0 MiB" not in out  # --top 2


def test_a_window_that_begins_mid_step_counts_what_was_live_before_it():
    """The history keeps its last events: blocks made before the window (a saved activation, the weights) are worked out
    from the snapshot's end state and the frees the window holds, so the peak is the allocator's whole count. Here the
    weights (500 MiB) outlive the window; an activation (300 MiB) made before it is freed in it after the peak."""
    events = [("alloc", 7, 100, LOSS), ("free_completed", 7, 100, LOSS), ("alloc", 8, 200, STEP),
              ("free_completed", 9, 300, LOSS), ("free_completed", 8, 200, STEP)]
    snapshot = {"device_traces": [[{"action": a, "addr": addr, "size": size * MiB, "frames": f}
                                   for a, addr, size, f in events]],
                "segments": [{"device": 0, "blocks": [
                    {"address": 1, "size": 500 * MiB, "state": "active_allocated", "frames": LIB},
                    {"address": 2, "size": 64 * MiB, "state": "inactive"}]}]}  # (a cached, free block)
    module = snapshot_peak()
    top, blocks, start = module.peak(snapshot["device_traces"][0], module.live_at_end(snapshot, 0))
    assert start == 800 * MiB and top == 1000 * MiB  # the weights and the activation, then the step's 200 MiB
    assert blocks == [(500 * MiB, "llama/modeling_llama.py:90 forward"),
                      (300 * MiB, "(made before the history), freed at training/loss.py:181 backward"),
                      (200 * MiB, "recipes/sft.py:120 train")]
    assert "peak 0.977 GiB allocated (0.781 GiB live when the history began; 5 events" in module.summary(snapshot)


def test_a_missing_snapshot_is_one_line_exit_2():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "snapshot_peak.py"), "/no/such.pickle"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("/no/such.pickle: no such file (memrecipe run "
                                                         "--memory-snapshot writes RUN/memory_snapshot_rank0.pickle on a GPU)")
