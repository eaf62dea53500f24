"""Run events: what the driver reports while it works, as typed records a display matches on by class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from poolbench.byte_size import size


@dataclass(frozen=True)
class ModelBuilding:
    """The model is converted (GGUF) or trained (tiny) before the run, once, so the wait is explained."""

    model: str


@dataclass(frozen=True)
class RunPlanned:
    """Every concept's cells are planned: what runs, on which model, on how many extractor workers."""

    model_id: str
    n_layers: int
    hidden_size: int
    concepts: tuple[str, ...]
    layers: tuple[int, ...]
    strategies: tuple[str, ...]
    worker_pids: tuple[int, ...]
    variants: tuple[str, ...] = ("main",)  # one pooling pass each over every concept: main, then --sites/lengths

    @property
    def passes(self) -> int:
        """Concept passes the run will pool and probe: every concept once per variant."""
        return len(self.concepts) * len(self.variants)

    @property
    def workers(self) -> int:
        """One extractor worker per pid."""
        return len(self.worker_pids)


@dataclass(frozen=True)
class PoolingFitted:
    """The pooling plan was cut to fit the extractors' host memory (driver.host_room): what was cut, in order."""

    steps: tuple[str, ...]
    budget: int  # bytes an extractor's jobs may hold

    @property
    def line(self) -> str:
        return (f"pooling fitted to {self.budget / 1e9:.1f} GB of host memory an extractor: "
                f"{'; '.join(self.steps)}")


@dataclass(frozen=True)
class PoolingRoom:
    """--drop-pooled: each concept's vectors leave the store once its D1 is stored, and the pooling runs ahead of D1
    only within `room` bytes of the disk at the start (read again at each decision: driver.room_gate); None where
    the store's room is not counted (S3)."""

    room: int | None
    free: int | None  # the store's free bytes at the start

    @property
    def line(self) -> str:
        head = "each concept's pooled vectors leave the store once its D1 is stored (--drop-pooled)"
        if self.room is None or self.free is None:
            return head
        return (f"{head}; the pooling runs ahead of D1 as far as {size(self.room)} of the store's disk allows, "
                f"with room for each concept's D1 files ({size(self.free)} free at the start)")


@dataclass(frozen=True)
class ConceptPooled:
    """A concept's PooledTable exists: pooled now (`seconds` of work, on `node`) or found in the store (`skipped`)."""

    concept: str
    skipped: bool
    seconds: float = 0.0
    node: str = ""  # `ip:port` of the node whose extractor pooled it ("" when found in the store)


@dataclass(frozen=True)
class ConceptProgress:
    """How far an extractor is inside one pooling job (passages and tokens through the model so far), polled while
    it pools, so a run on a large model shows movement before the concept ends. A job may pool several concepts
    in shared forwards: `group` names them all (`concept` is the first) and the counts cover them together."""

    concept: str
    batches: int
    passages_done: int
    passages_total: int
    tokens_done: int
    seconds: float
    group: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The concept, or every concept in flight in the job."""
        return "+".join(self.group) if len(self.group) > 1 else self.concept

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far (None before the first batch is through)."""
        if self.passages_done == 0:
            return None
        return self.seconds * (self.passages_total - self.passages_done) / self.passages_done


@dataclass(frozen=True)
class CellProgress:
    """How far a steering call's generation is (tokens sampled over its cells' alpha grids x prompts), polled while
    it generates, so the D2 stage shows movement inside a call; names its first cell and how many cells it holds."""

    concept: str
    strategy: str
    layer: int
    tokens_done: int
    tokens_total: int
    seconds: float
    cells: int = 1
    worker_pid: int = 0  # the steering actor's process, so an operator (or a fault test) can find it

    @property
    def eta_s(self) -> float | None:
        """Seconds left in this generation at the pace so far (None before the first token)."""
        if self.tokens_done == 0:
            return None
        return self.seconds * (self.tokens_total - self.tokens_done) / self.tokens_done


@dataclass(frozen=True)
class ConceptProbed:
    """A concept's D1 records exist: probed now or found in the store (`skipped`)."""

    concept: str
    skipped: bool


@dataclass(frozen=True)
class LayerProbed:
    """One layer of a concept probed now (its D1 cells with reliability, one task) and where the task's seconds
    went: reading its pooled shards from the store, the fits, writing its records and scores. The driver's D1 of a
    concept is its slowest layer after the queue; these say whether a slow one waited on the store or on the fits
    (bench/scale.py, bench/measured/h200_session36: 2 x 19 x 6 cells in 26.7 s on an H200, where one process fits
    a cell in 0.21 s)."""

    concept: str
    layer: int
    cells: int
    read_s: float
    probe_s: float
    write_s: float
    node: str = ""
    wall_s: float = 0.0  # from the task's submission to the driver seeing its result: waits and process start too
    pid: int = 0  # the worker process that ran it
    earlier_tasks: int = 0  # probe tasks that process ran before this one (0: it paid the process's start)
    devices: str = ""  # the GPUs Ray made visible to it (CUDA_VISIBLE_DEVICES; "" on a CPU run)


@dataclass(frozen=True)
class SteeringPlanned:
    """D2/D3 is about to run: how many cells, and how many scorers they need."""

    cells: int
    scorers: int


@dataclass(frozen=True)
class SteeringStarted:
    """The steering engines are loaded: their processes and the nodes (`ip:port`) they run on, one per engine."""

    worker_pids: tuple[int, ...]
    nodes: tuple[str, ...]
    engines: tuple[str, ...] = ()  # vLLM engines: each one's mode and start-up (load, compile, capture), one line


@dataclass(frozen=True)
class ScorerReady:
    """A concept's classifier B is trained (or fetched) and valid."""

    concept: str
    heldout_auroc: float
    seconds: float


@dataclass(frozen=True)
class CellSteered:
    """One (concept, strategy, layer) steering cell is done; SCP and Delta are None for a null cell."""

    concept: str
    strategy: str
    layer: int
    scp: float | None
    d2_delta: float | None


@dataclass(frozen=True)
class ArtifactQuarantined:
    """A stored artifact failed its checksum: moved to quarantine/ and recomputed, so the run goes on."""

    key: str
    reason: str


@dataclass(frozen=True)
class JobRetried:
    """A job whose worker (or the worker's whole node) was lost goes to another worker: what, where, why, try.

    `how`: "lost" (the GCS declared the node dead), "unreachable" (its worker stopped answering before the GCS
    decided: a node going down looks like this for its first seconds) or "died" (the process died, the node lives)."""

    job: str
    attempt: int
    cause: str
    node: str = ""
    how: str = "died"
    on: str = ""

    @property
    def line(self) -> str:
        """One progress line: `node 127.0.0.1:4242 lost; retrying pool code_docs on 127.0.0.1:4343 (attempt 2)`."""
        node = self.node or "an unknown node"
        where = f"worker on {node} died" if self.how == "died" else f"node {node} {self.how}"
        return f"{where}; retrying {self.job} on {self.on or 'a new worker'} (attempt {self.attempt})"

    def to_dict(self) -> dict:
        return {"job": self.job, "attempt": self.attempt, "cause": self.cause, "node": self.node, "how": self.how,
                "on": self.on}


RunEvent = (ArtifactQuarantined | JobRetried | ModelBuilding | RunPlanned | PoolingFitted | PoolingRoom
            | ConceptPooled
            | ConceptProgress
            | CellProgress | LayerProbed | ConceptProbed
            | SteeringPlanned | SteeringStarted | ScorerReady | CellSteered)
EventSink = Callable[[RunEvent], None]


def ignore_event(event: RunEvent) -> None:
    """The sink of a run nobody watches."""
