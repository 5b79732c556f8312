"""What the CUDA allocator held at its peak, from the history `memrecipe run --memory-snapshot` writes
(memory_snapshot_rank0.pickle): the largest allocations live at that moment, each with the code that made it, and
the bytes grouped by that code. A few lines say which term a plan missed, where the pickle is tens of MB (open it at
https://pytorch.org/memory_viz to look further).

    python benchmarks/snapshot_peak.py RUN/memory_snapshot_rank0.pickle [--top 15]

Replays the history (torch/cuda/_memory_viz.py's trace reads it the same way): `alloc` adds a block, `free_completed`
returns it (the allocator's own count: a block freed on one stream waits for the others). The history keeps its last
events only (a tiled long-context step overran 100,000), so what was live when it began is worked out backwards from
the snapshot's end state (its segments' allocated blocks): the peak is the allocator's whole count, and a block made
before the window is named by where it is freed in it, or as made before it. The backward's allocations are made by
autograd's C++ thread: their innermost Python frame is the call to backward.
"""

import argparse
import pickle
from collections import Counter
from pathlib import Path

GiB, MiB = 2**30, 2**20
HERE = ("memrecipe", "/recipes/", "/cli/")  # this project's code: the frame that names the term


def where(frames: list[dict]) -> str:
    """The innermost frame in this project's code, else the innermost of any: `file:line function`."""
    mine = [f for f in frames if any(part in f["filename"] for part in HERE)]
    frame = (mine or frames or [{"filename": "(no Python frame)", "line": 0, "name": ""}])[0]
    return f"{'/'.join(Path(frame['filename']).parts[-2:])}:{frame['line']} {frame['name']}".strip()


BEFORE = "(made before the history)"


def live_at_end(snapshot: dict, device: int) -> dict[int, tuple[int, str]]:
    """The blocks allocated when the snapshot was taken, by address: (bytes, the code that made them)."""
    return {b["address"]: (b["size"], where(b["frames"]) if b.get("frames") else BEFORE)
            for segment in snapshot.get("segments", []) if segment.get("device", 0) == device
            for b in segment.get("blocks", []) if b.get("state") == "active_allocated"}


def peak(trace: list[dict], end: dict[int, tuple[int, str]] | None = None) -> tuple[int, list[tuple[int, str]], int]:
    """(the peak's bytes, the blocks live at it: (bytes, where), largest first, the bytes live when the history
    began). `end`: the blocks live at the end (live_at_end); without it the bytes count from 0 at the start and
    blocks made before it are left out."""
    freed = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
    made_here, live = set(), {}
    for e in trace:  # the blocks live at the start: freed before any alloc of their address here
        if e["action"] == "alloc":
            made_here.add(e["addr"])
        elif e["action"] == freed and e["addr"] not in made_here and e["addr"] not in live:
            live[e["addr"]] = (e["size"], f"{BEFORE}, freed at {where(e.get('frames') or [])}")
    live |= {addr: block for addr, block in (end or {}).items() if addr not in made_here}
    start = total = top = sum(size for size, _ in live.values())
    at = -1
    for i, e in enumerate(trace):  # when the peak is
        total += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == freed else 0
        if total > top:
            top, at = total, i
    for e in trace[:at + 1]:  # what is live then
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames") or []))
        elif e["action"] == freed:
            live.pop(e["addr"], None)
    return top, sorted(live.values(), reverse=True), start


def summary(snapshot: dict, count: int = 15) -> str:
    lines = []
    for device, trace in enumerate(snapshot["device_traces"]):
        if not trace:
            continue
        end = live_at_end(snapshot, device)
        top, blocks, start = peak(trace, end)
        held = (f"{start / GiB:.3f} GiB live when the history began" if end or start else
                "above the history's start: the snapshot lists no live blocks")
        lines.append(f"device {device}: peak {top / GiB:.3f} GiB allocated ({held}; {len(trace)} events, "
                     f"{len(blocks)} blocks live at the peak)")
        lines.append("  largest blocks live at the peak:")
        lines += [f"    {size / MiB:10.1f} MiB  {code}" for size, code in blocks[:count]]
        by_code = Counter()
        for size, code in blocks:
            by_code[code] += size
        lines.append("  the peak's bytes by the code that made them:")
        lines += [f"    {size / MiB:10.1f} MiB  {code}" for code, size in by_code.most_common(count)]
    return "\n".join(lines) or "no allocator history in this snapshot"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--top", type=int, default=15, help="how many blocks and places to list")
    args = parser.parse_args()
    if not args.snapshot.is_file():
        parser.error(f"{args.snapshot}: no such file (memrecipe run --memory-snapshot writes "
                     "RUN/memory_snapshot_rank0.pickle on a GPU)")
    with open(args.snapshot, "rb") as f:
        print(summary(pickle.load(f), args.top))


if __name__ == "__main__":
    main()
