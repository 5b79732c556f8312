"""The activation ladder: what a recipe can give up, rung by rung, to train a longer sequence. At long context the
activations, not the model states, fill the GPU; each rung keeps fewer of them on it for more recompute or more
traffic to the host (docs/long-context.md). A rung is the key=value words that climb to it from the recipe as
written, so a plan names exactly what to add to the command line."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RecipeError
from .architecture import Structure
from .forecast import Rates
from .planner import Verdict, decide_dropout, estimate, judge
from .recipe import Recipe
from .registry import merge, parse_overrides
from .rungs import LADDER
from .rules import make_recipe
from .topology import Topology, check_supported

STEP = 1024  # lengths are searched in whole K of tokens (128K = 131,072)
LIMIT = 16 * 1024 * 1024  # the longest searched: 16M tokens, past anything one process holds


@dataclass(frozen=True)
class Rung:
    name: str
    words: tuple[str, ...]  # the key=value words that climb to it from the recipe as written


def with_words(recipe: Recipe, words) -> Recipe:
    """The recipe with key=value words added, checked by the same rules as a recipe file (RecipeError if refused)."""
    return make_recipe(merge(recipe.to_dict(), parse_overrides(words))) if words else recipe


def rung_of(recipe: Recipe, processes: int | None = None) -> str:
    """The rung the recipe stands on: the highest whose technique it uses (on `processes`, when given: sequence
    parallelism over one process splits nothing)."""
    return next(rung.name for rung in reversed(LADDER) if rung.on(recipe, processes))


def rungs(recipe: Recipe) -> list[Rung]:
    """The recipe's own rung, then those above it that its rules accept, cheapest first (climbs)."""
    return [rung for rung, _ in climbs(recipe)]


def climbs(recipe: Recipe, topo: Topology | None = None):
    """(rung, the recipe on it) for the recipe's own rung and each of LADDER's it climbs to that its rules (and
    `topo`, when given) accept, cheapest first: each rung's words add to those of the last accepted below it (a rung
    the rules refuse, FSDP's tiled MLP, is stepped over)."""
    below = ()
    for technique in (None, *(t for t in LADDER if t.offered(recipe, topo))):
        rung = Rung(rung_of(recipe, topo.num_processes if topo else None), ()) if technique is None else \
            Rung(technique.name, technique.words(recipe, topo, below))
        try:
            climbed = with_words(recipe, rung.words)
            if topo is not None:
                check_supported(climbed, topo)
        except RecipeError:  # a rung its rules, or this topology, refuse
            continue
        below = rung.words
        yield rung, climbed


def climb(recipe: Recipe, s: Structure, topo: Topology, gpu_memory, host_memory) -> tuple[Recipe, Rung, bool]:
    """(the recipe at the cheapest rung that fits at its own length, that rung, True); when none does, the rung that
    comes closest (the most spare memory, or the least missing; of rungs that run, where some do: the first where
    none does, a kernel refused whatever the memory), and False: a refusal quotes what the ladder can reach, not the
    recipe as written."""
    closest = None
    for rung, climbed in climbs(recipe, topo):
        _, verdict = decide_dropout(climbed, s, topo, gpu_memory, host_memory)  # (`auto` left for its row to decide)
        if verdict.fits:
            return climbed, rung, True
        runs = verdict.estimate.refused is None
        spare = verdict.headroom if verdict.headroom is not None else -verdict.estimate.total
        key = (runs, spare if runs else 0)
        if closest is None or key > closest[0]:
            closest = (key, climbed, rung)
    if closest is None:
        return recipe, Rung(rung_of(recipe, topo.num_processes), ()), False
    return closest[1], closest[2], False


def longest(recipe: Recipe, s: Structure, topo: Topology, gpu_memory, host_memory,
            rates: Rates | None = None) -> tuple[int, Verdict | None]:
    """The longest sequence, in whole K of tokens, that fits at micro batch 1 (memory grows with the length: a
    binary search), with its verdict (its step time forecast at `rates`: planner.estimate); (0, None) when not even
    1K fits."""
    def verdict(k: int) -> Verdict:
        return judge(estimate(recipe, s, topo, micro_batch=1, seq_length=k * STEP, rates=rates), gpu_memory,
                     host_memory)

    low, high, best = 0, LIMIT // STEP, None
    while low < high:
        middle = (low + high + 1) // 2
        v = verdict(middle)
        if v.fits:
            low, best = middle, v
        else:
            high = middle - 1
    return low * STEP, best


@dataclass(frozen=True)
class Longest:
    recipe: Recipe  # at the rung that reaches furthest
    rung: Rung
    seq_length: int  # 0: not even 1K fits
    verdict: Verdict | None


def longest_per_recipe(recipe: Recipe, s: Structure, topo: Topology, gpu_memory, host_memory,
                       rates: Rates | None = None) -> Longest:
    """A recipe's longest sequence at micro batch 1 over the rungs it can climb (a rung its rules refuse is left
    out): the cheapest rung among those that reach furthest."""
    one = with_words(recipe, ["per_device_train_batch_size=1"])
    best = Longest(one, Rung(rung_of(one, topo.num_processes), ()), 0, None)
    for rung, climbed in climbs(one, topo):
        length, verdict = longest(climbed, s, topo, gpu_memory, host_memory, rates)
        if length > best.seq_length:
            best = Longest(climbed, rung, length, verdict)
    if best.seq_length:  # (searched as an undecided `auto` plans, redrawn: the most a length can get)
        decided, verdict = decide_dropout(best.recipe, s, topo, gpu_memory, host_memory, 1, best.seq_length, rates)
        best = Longest(decided, best.rung, best.seq_length, verdict)
    return best


def tokens(length: int) -> str:
    """128K for 131,072: lengths as people write them."""
    return f"{length // STEP:,}K" if length >= STEP else f"{length:,}"
