"""Where a run goes: processes, machines, rendezvous address, CPU smoke-test mode."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import RecipeError
from .recipe import METHODS, Recipe, method


@dataclass(frozen=True)
class Topology:
    num_processes: int = 1  # total, over all machines (= GPUs, or CPU processes in smoke-test mode)
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    cpu: bool = False  # CPU smoke-test mode: gloo, no GPU
    bf16: bool | None = None  # does the GPU do bf16? None: unknown (configs made off the target machine)

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def name(self) -> str:
        """File-name form: cpu2, 1gpu, 8gpu, 2x8gpu-rank0."""
        if self.cpu:
            base = f"cpu{self.num_processes}"
        elif self.num_machines == 1:
            base = f"{self.num_processes}gpu"
        else:
            base = f"{self.num_machines}x{self.processes_per_machine}gpu"
        return f"{base}-rank{self.machine_rank}" if self.num_machines > 1 else base

    def describe(self) -> str:
        """Human form: '2 CPU processes', '8 GPUs', '2 machines x 8 GPUs (this is rank 0)'."""
        n = self.processes_per_machine
        unit = ("CPU process" if n == 1 else "CPU processes") if self.cpu else ("GPU" if n == 1 else "GPUs")
        per = f"{n} {unit}"
        return per if self.num_machines == 1 else f"{self.num_machines} machines x {per} (this is rank {self.machine_rank})"


def make_topology(num_processes=1, num_machines=1, machine_rank=0, main_process_ip=None, main_process_port=None,
                  cpu=False, bf16=None) -> Topology:
    """A checked Topology from CLI flags."""
    if num_processes < 1:
        raise RecipeError(f"--num-processes must be >= 1, got {num_processes}")
    if num_machines < 1:
        raise RecipeError(f"--num-machines must be >= 1, got {num_machines}")
    if num_processes % num_machines:
        raise RecipeError(
            f"--num-processes is the total over all machines and must divide evenly: "
            f"{num_processes} processes on {num_machines} machines"
        )
    if not 0 <= machine_rank < num_machines:
        raise RecipeError(f"--machine-rank must be between 0 and {num_machines - 1}, got {machine_rank}")
    if num_machines > 1 and not main_process_ip:
        raise RecipeError("--num-machines > 1 needs --main-process-ip (the address of machine rank 0)")
    if main_process_port is not None and not 1 <= main_process_port <= 65535:
        raise RecipeError(f"--main-process-port must be between 1 and 65535, got {main_process_port}")
    if num_machines > 1 and main_process_port is None:
        main_process_port = 29500
    return Topology(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, cpu, bf16)


def plan_topology(recipe: Recipe, machine, num_processes=None, num_machines=1, machine_rank=0,
                  main_process_ip=None, main_process_port=None, cpu=False,
                  refused: list | None = None) -> tuple[Recipe, Topology]:
    """The topology for this run, and the recipe with its precision decided on it: the flags, else every GPU (as
    many as the recipe takes), else the CPU smoke-test form (1 process, or 2 for recipes that shard). What this
    machine cannot hold (GPUs, cores) is refused, or with `refused` (a dry run) listed there."""
    cpu = cpu or machine.gpus == 0
    s = recipe.supports
    if num_processes is None:
        if cpu:
            num_processes = 1 if s.max_processes == 1 and s.min_processes == 1 else max(2, s.min_processes)
        else:
            num_processes = min(machine.gpus, s.max_processes or machine.gpus) * num_machines
    topo = make_topology(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, cpu,
                         None if cpu else machine.bf16)
    recipe = decide(recipe, topo)
    check_supported(recipe, topo)
    local, why = topo.processes_per_machine, None
    if not cpu and local > machine.gpus:
        why = (f"{local} processes per machine need {local} GPUs; this machine has {machine.gpus}: "
               f"lower --num-processes")
    if cpu and local > machine.cores:
        why = (f"{local} CPU processes need {local} cores; this machine has {machine.cores} (to prepare "
               f"a GPU run from here: memrecipe config {recipe.name} --num-processes {num_processes}, "
               f"or memrecipe slurm {recipe.name}, write its files)")
    if why and refused is None:
        raise RecipeError(why)
    if why:
        refused.append(why)
    return recipe, topo


def launched_topology(num_processes: int, cpu: bool, bf16: bool | None = None) -> Topology:
    """The topology a running process was launched on, read from torchrun's environment (a launch that
    did not come through `memrecipe run`, e.g. plain `accelerate launch` or the slurm script)."""
    import os

    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    machines = max(1, num_processes // max(1, local))
    address = os.environ.get("MASTER_ADDR") if machines > 1 else None
    port = int(os.environ["MASTER_PORT"]) if machines > 1 and "MASTER_PORT" in os.environ else None
    return make_topology(num_processes, machines, int(os.environ.get("GROUP_RANK", 0)), address, port, cpu, bf16)


def resolve_precision(recipe: Recipe, topo: Topology) -> str:
    """`auto` -> bf16 where the hardware does it (CPU, Ampere+), else fp16 with loss scaling."""
    if recipe.mixed_precision != "auto":
        return recipe.mixed_precision
    if topo.cpu or topo.bf16 is not False:
        return "bf16"
    return "fp16"


def decide(recipe: Recipe, topo: Topology) -> Recipe:
    """The recipe with what depends on the topology decided: its precision (`auto` -> bf16 or fp16) and its
    sequence-parallel group (parallelism.sp_size null -> all the processes). Decided once where a run's plan starts,
    so the configs, the estimate and the run folder's recipe.yaml read the same answer."""
    if recipe.parallelism is not None and recipe.parallelism.sp_size is None:
        group = recipe.sequence_group(topo.num_processes)
        recipe = replace(recipe, parallelism=replace(recipe.parallelism, sp_size=group))
    return replace(recipe, mixed_precision=resolve_precision(recipe, topo))


def recipes_for(recipe: Recipe, processes: int) -> str:
    """The shipped recipes that take this many processes, those that train the same way (full, LoRA, QLoRA)
    first, then the nearest way: 'fsdp-qlora, fsdp-lora (LoRA) or ...'."""
    from .registry import load_recipe, recipe_names

    fits = [r for r in map(load_recipe, recipe_names()) if r.supports.min_processes <= processes
            and (r.supports.max_processes or processes) >= processes]
    nearest = {"full": ("full", "lora", "qlora"), "lora": ("lora", "qlora", "full"), "qlora": ("qlora", "lora", "full")}
    ordered = sorted(fits, key=lambda r: nearest[method(recipe)].index(method(r)))
    words = [r.name + ("" if method(r) == method(recipe) else f" ({METHODS[method(r)]})") for r in ordered[:3]]
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else (words[0] if words else "another recipe")


def check_heads(sp: int, heads: int, kv_heads: int) -> None:
    """Ulysses gives each process of the group heads / sp query heads and kv_heads / sp key/value heads (each
    replicated sp / kv_heads times where there are fewer: DeepSpeed's UlyssesSPAttentionHF)."""
    if sp > 1 and (heads % sp or (kv_heads % sp and sp % kv_heads)):
        fits = [k for k in range(2, heads + 1) if not heads % k and (not kv_heads % k or not k % kv_heads)]
        raise RecipeError(f"parallelism.sp_size={sp} must divide the model's {heads} attention heads, and its "
                          f"{kv_heads} key/value heads divide by it or it by them: use sp_size "
                          f"{' or '.join(map(str, fits)) or '1'}")


def check_supported(recipe: Recipe, topo: Topology) -> None:
    """Refuse a topology the recipe does not support, saying which recipe would."""
    s = recipe.supports
    n = topo.num_processes
    if n < s.min_processes:
        raise RecipeError(
            f"recipe {recipe.name} needs at least {s.min_processes} processes (supports.min_processes), "
            f"got {n}: use --num-processes {s.min_processes}, or single-gpu-lora / zero3-offload for one GPU"
        )
    if s.max_processes is not None and n > s.max_processes:
        raise RecipeError(f"recipe {recipe.name} runs on at most {s.max_processes} process(es) (supports.max_processes), "
                          f"got {n}: to train on {n} GPUs use {recipes_for(recipe, n)}")
    if recipe.tensor_parallel > 1:
        tp = recipe.tensor_parallel
        if n % tp or n // tp < 2:
            raise RecipeError(f"recipe {recipe.name} splits each layer over parallelism.tp_size={tp} processes and "
                              f"shards the rest with FSDP2: --num-processes must be a multiple of {tp}, at least "
                              f"{2 * tp}; got {n}")
    sp = recipe.sequence_group(n)  # (null until `decide`)
    if n % sp:
        raise RecipeError(f"recipe {recipe.name} splits each sequence over parallelism.sp_size={sp} processes: "
                          f"--num-processes must be a multiple of {sp}, got {n}")
    cp = recipe.context_parallel
    if n % cp:
        raise RecipeError(f"recipe {recipe.name} splits each sequence over parallelism.cp_size={cp} processes (ring "
                          f"attention): --num-processes must be a multiple of {cp}, got {n}")
    if recipe.tiled_mlp is not False and n > 1 and recipe.deepspeed is None:
        raise RecipeError(f"tiled_mlp runs on one process or under DeepSpeed: DDP syncs each weight's gradient once, "
                          f"and the tiles give it in parts; got {n} processes: use --num-processes 1, or set "
                          "tiled_mlp=false")
    if resolve_precision(recipe, topo) == "fp16" and recipe.fp16_blocker:
        raise RecipeError(f"recipe {recipe.name}: mixed_precision auto is fp16 on GPUs without bf16 (before Ampere), "
                          f"and {recipe.fp16_blocker}: run it on a GPU with bf16, or use another recipe")
    blocker = recipe.cpu_blocker if topo.cpu else None
    if blocker and blocker.startswith("attn_implementation="):  # a key's choice, not what the recipe is
        raise RecipeError(f"{blocker}: set it so, or run where there are GPUs")
    if blocker and blocker.startswith("ring attention") and recipe.supports.cpu:  # the key's, not the recipe's
        raise RecipeError(f"parallelism.cp_size={recipe.context_parallel} is GPU-only: {blocker}; set "
                          "parallelism.cp_size=1 to run the recipe here, or run where there are GPUs")
    if blocker:
        raise RecipeError(f"recipe {recipe.name} is GPU-only: {blocker}; generate and check its GPU configs with "
                          f"memrecipe config {recipe.name} (no --cpu), and run it where there are GPUs")
    if topo.num_machines > 1 and not s.multi_node:
        raise RecipeError(f"recipe {recipe.name} runs on one machine (supports.multi_node is false)")
