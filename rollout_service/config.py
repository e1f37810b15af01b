"""Engine and service configuration: dataclasses that validate themselves and round-trip through YAML."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from rollout_service.api.values import is_int, is_number

# The one table of ops backends and dtype names (torch-free, so a command line can read it at once).
OPS_BACKENDS = ("torch", "cuda")  # the ops backends an engine runs on (ops/backend.py)
ENGINE_BACKENDS = ("auto", *OPS_BACKENDS)  # what EngineConfig.backend takes: "auto" picks one at start
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def cache_dir() -> Path:
    """Where the service keeps what it builds once (converted models, compiled kernels): $ROLLOUT_SERVICE_CACHE,
    else $XDG_CACHE_HOME/rollout_service, else ~/.cache/rollout_service."""
    if os.environ.get("ROLLOUT_SERVICE_CACHE"):
        return Path(os.environ["ROLLOUT_SERVICE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "rollout_service"

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPES = (None, *DTYPE_NAMES)
ON_REFRESH = ("continue", "recompute", "abort")
SCHEDULING = ("staleness", "fifo")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ROUTINGS = ("prefix", "load")


def _fail(cls: str, name: str, value: Any, why: str) -> None:
    raise ValueError(f"{cls}.{name}={value!r}: {why}")


def from_mapping(cls, d: dict, where: str):
    """Build dataclass `cls` from a mapping, naming unknown keys instead of ignoring them."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}{did_you_mean(unknown, known)}; "
                         f"allowed: {sorted(known)}")
    return cls(**d)


def did_you_mean(unknown: list, known: set) -> str:
    """' (did you mean 'x'?)' for the first unknown key with a close known one, else ''."""
    import difflib
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


@dataclass
class EngineConfig:
    """One engine on one device. `num_pages=None` sizes the KV pool from `kv_cache_memory_gb` (or, on a
    GPU, from `gpu_memory_utilization` of the free memory)."""

    model: Any = "smollm2-135m"
    # "dummy": read only the model's config, random weights (the first refresh brings the real ones); "share": a
    # live transformers model's own tensors are the engine's weights, not a copy (model/shared_weights.py)
    load_format: str = "auto"
    backend: str = "auto"
    dtype: str | None = None
    device: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    # launch decode step t+1 (fed the sampled ids on the device) before reading step t's tokens, so the host's
    # bookkeeping runs while the GPU works; tokens and log-probs are the same either way
    overlap_decode: bool = True
    seed: int = 0
    on_refresh: str = "continue"  # what a refresh does to sequences in flight: engine/weight_swap.py
    # Which waiting sequence is admitted first and which running one is preempted first: "staleness" orders
    # by the policy version the request was submitted under (oldest first), then arrival, so samples that a
    # refresh is making stale finish before newer ones start; "fifo" by arrival alone (engine/scheduler.py).
    scheduling: str = "staleness"
    # Reuse the KV of full pages across requests whose tokens match up to the page's end (shared system
    # prompts, the n samples' prompt on recompute, an episode's history). Keys carry the policy version:
    # after a refresh, KV of the old weights stops matching, unless prefix_cache_across_versions (off: the
    # old KV would silently mix two policies in one sample's log-probs).
    enable_prefix_cache: bool = True
    prefix_cache_across_versions: bool = False
    # The CUDA prefill kernel's P·V: False rounds the softmax weights P to the model dtype once, as flash
    # attention does (fast; log-prob fidelity measured at HF bf16's level, docs/learner-api.md); True keeps P to float32
    # precision (P in 2-3 parts, ~2x the prefill attention time). Decode attention is exact either way.
    exact_prefill_attention: bool = False
    # A sequence's tokens and log-probs bitwise the same whatever its batch mates, step kind (prefill, decode,
    # recompute) or prompt sharing, and equal to rollout_service.training.InvariantForward's recompute: every
    # product on fixed row tiles, attention in one fixed order per query (ops/invariant.py on the torch
    # backend, ops/invariant_cuda.py on the cuda backend, with CUDA graphs).
    batch_invariant: bool = False
    # "fp8": the attention and MLP projections run as float8 e4m3 products with per-channel weight scales and
    # per-token activation scales, quantized from the model dtype at load and at every refresh
    # (model/quantize.py); embeddings, norms, router and LM head stay in the model dtype. Needs a bf16/fp16
    # model (and FP8 tensor cores on a GPU; the torch backend computes the same arithmetic anywhere).
    quantization: str | None = None
    # A secret shared with the learner: batch-invariant receipts become HMACs under it, which only a holder of
    # the key can produce for edited content (rollout_service/results/receipts.py). Kept out of repr.
    receipt_key: str | None = field(default=None, repr=False)
    # "suffix": exact speculative decoding, drafts from text already seen (engine/speculation.py); None: off
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 32

    def __post_init__(self) -> None:
        c = "EngineConfig"
        if self.receipt_key is not None and not (isinstance(self.receipt_key, str) and self.receipt_key):
            raise ValueError("EngineConfig.receipt_key: must be None or a non-empty str")
        if self.quantization not in (None, "fp8"):
            _fail(c, "quantization", self.quantization, "must be None or 'fp8'")
        if self.load_format not in ("auto", "dummy", "share"):
            _fail(c, "load_format", self.load_format, "must be 'auto', 'dummy' or 'share'")
        if self.backend not in ENGINE_BACKENDS:
            _fail(c, "backend", self.backend, f"must be one of {ENGINE_BACKENDS}")
        if self.dtype not in DTYPES:
            _fail(c, "dtype", self.dtype, f"must be one of {DTYPES}")
        if self.device is not None and not str(self.device).startswith(("cpu", "cuda")):
            _fail(c, "device", self.device, "must be 'cpu', 'cuda' or 'cuda:N'")
        if self.page_size not in (8, 16, 32, 64):
            _fail(c, "page_size", self.page_size, "must be one of 8, 16, 32, 64")
        if self.speculative not in (None, "suffix"):
            _fail(c, "speculative", self.speculative, "must be None or 'suffix'")
        for name in ("max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_batch", "num_speculative_tokens",
                     "speculative_max_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                _fail(c, name, v, "must be an int >= 1")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            _fail(c, "num_pages", self.num_pages, "must be None or an int >= 2 (page 0 is reserved)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            _fail(c, "max_model_len", self.max_model_len, "must be None or an int >= 2")
        if not 0 < self.gpu_memory_utilization <= 0.98:
            _fail(c, "gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 0.98]")
        for name in ("overlap_decode", "enable_prefix_cache", "prefix_cache_across_versions",
                     "exact_prefill_attention", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                _fail(c, name, getattr(self, name), "must be a bool")
        if not self.kv_cache_memory_gb > 0:
            _fail(c, "kv_cache_memory_gb", self.kv_cache_memory_gb, "must be > 0")
        if self.on_refresh not in ON_REFRESH:
            _fail(c, "on_refresh", self.on_refresh, f"must be one of {ON_REFRESH}")
        if self.scheduling not in SCHEDULING:
            _fail(c, "scheduling", self.scheduling, f"must be one of {SCHEDULING}")
        if self.on_refresh == "recompute" and self.prefix_cache_across_versions:
            _fail(c, "on_refresh", self.on_refresh, "recomputes the KV under the new weights; "
                  "prefix_cache_across_versions would serve the old KV again (turn one of them off)")

    def to_dict(self) -> dict:
        d = asdict(self)
        if not isinstance(d["model"], str):
            d["model"] = repr(type(self.model).__name__)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        return from_mapping(cls, d, "engine config")


# ---------------------------------------------------------------------------------------------------
# Service configuration (the Ray side): what a cluster_configs/*.yaml file holds.


def local_ray_wanted(address: str | None) -> bool:
    """Whether `address`, else $RAY_ADDRESS, asks for a new local Ray instance (unset or "local") rather than
    naming a cluster to join. Ray-free, so a launcher can judge it before importing Ray."""
    return (address or os.environ.get("RAY_ADDRESS") or "local") == "local"



@dataclass
class WorkerResources:
    """Ray resources each rollout worker reserves. `num_gpus: auto` = 1 when the cluster has GPUs, else 0.
    `custom` names custom node resources (e.g. {"rollout_node": 1}) so workers land only on nodes
    started with them (`ray start --resources='{"rollout_node": 4}'`)."""

    num_cpus: float = 1.0
    num_gpus: Any = "auto"
    memory_gb: float | None = None
    custom: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = "ServiceConfig.resources"
        if not is_number(self.num_cpus) or self.num_cpus < 0:
            _fail(c, "num_cpus", self.num_cpus, "must be a number >= 0")
        if self.num_gpus != "auto" and (not is_number(self.num_gpus) or self.num_gpus < 0):
            _fail(c, "num_gpus", self.num_gpus, "must be 'auto' or a number >= 0")
        if self.memory_gb is not None and (not is_number(self.memory_gb) or self.memory_gb <= 0):
            _fail(c, "memory_gb", self.memory_gb, "must be None or a number > 0")
        if not isinstance(self.custom, dict) or not all(
                isinstance(k, str) and k and is_number(v) and v > 0 for k, v in self.custom.items()):
            _fail(c, "custom", self.custom, "must map resource names to numbers > 0")
        if {"CPU", "GPU", "memory"} & set(self.custom):
            _fail(c, "custom", self.custom, "use num_cpus / num_gpus / memory_gb for CPU, GPU and memory")



@dataclass
class Placement:
    """How the workers' resource bundles are spread over nodes: the workers started together share one Ray
    placement group, one bundle each (a later scale() that needs bundles adds a group: actors/slots.py).
    STRICT_SPREAD = one worker per node; PACK = as few nodes as possible. `timeout_s`: how long a start or a
    scale waits for its workers to be placed and built before it fails."""

    strategy: str = "PACK"
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.strategy not in PLACEMENT_STRATEGIES:
            _fail("ServiceConfig.placement", "strategy", self.strategy, f"must be one of {PLACEMENT_STRATEGIES}")
        if not is_number(self.timeout_s) or self.timeout_s <= 0:
            _fail("ServiceConfig.placement", "timeout_s", self.timeout_s, "must be a number > 0")


@dataclass
class ServiceConfig:
    """A rollout service: `num_workers` Ray actors, each owning one Engine built from `engine`.

    num_workers: an int, or "auto" = one per GPU in the cluster (one worker on a CPU-only cluster).
    sampling: default SamplingParams fields for `rollout-service run` / the launch job.
    max_staleness: None (off) or an int k >= 0. A result whose OLDEST token was produced by policy
        version v is stale when `current_version - v > k`; the router then does not deliver it and
        regenerates the whole request with the current weights (samples already delivered are not
        repeated). With k = 0 every delivered result was generated entirely by the latest policy. A request
        regenerated twice is pinned: refreshes wait (at most 30 s each) until no pinned request is in flight,
        so a storm of refreshes cannot starve it (actors/dispatch.py).
    max_restarts: how often Ray restarts a crashed worker; its unfinished requests go to live workers
        meanwhile, and a restarted worker is given the latest weights before it serves again.
    detached: keep the service alive after the launching process exits (connect to it by `name`, stop it
        with `rollout-service stop`). It needs a Ray cluster that outlives the process too, started with
        `ray start --head`: `rollout-service serve` sets both.
    address: Ray cluster to join when this process is not connected yet: None = $RAY_ADDRESS (set
        inside `ray job submit`), else a new local Ray instance; "auto" = the cluster started with
        `ray start` on this machine; or "HOST:PORT".
    prompts / apply_chat_template: the launch job's input (JSONL; None = built-in sample set).
    output: the launch job's msgpack results file, anywhere: relative paths are taken from the current
        directory (inside `ray job submit`, Ray's temporary copy of --working-dir, so give an absolute one
        there) and a missing folder is made; None = rollout_results.msgpack.
    colocate: every worker's bundle (`resources`) is shared with one learner on the same devices: the worker
        takes half of the bundle's CPUs and GPUs (a restarted worker too), and `RolloutClient.colocated_options(i)`
        places a learner actor in worker i's bundle with the other half; they take turns with sleep() / wake_up().
    client_lease_s: how long a client process may go silent before the service stops holding what it asked for:
        its open streams are cancelled, and a sleep() it asked for ends (the workers wake and serve the last
        weights). A live client renews its leases from a background thread.
    reward: the default reward function, an importable "package.module:function" (fn(result) -> float),
        for requests that name none (RolloutRequest.reward); None: no reward. It is imported when the
        config is loaded, so a name that cannot be imported fails at launch.
    reward_workers: 0 = rewards are computed in each rollout worker's own threads; k > 0 = in k Ray reward
        actors shared by the workers (for slow or CPU-heavy reward functions; they reserve no CPU).
    user_code_timeout_s: a reward function or environment call that runs longer than this in a rollout worker
        has wedged it: the worker is restarted and that request finishes with the error, never run again
        (actors/quarantine.py). Rewards computed in reward actors are not timed.
    refresh_stall_s: a worker that leaves a refresh call unanswered this long (stopped, not dead) fails that
        refresh, naming it: the others keep their version and it is restarted (a broadcast's receive gets the
        group's timeout on top).
    routing: "prefix" (default): to the worker whose prefix cache most likely holds the start of the prompt,
        unless it is overloaded, else by load (actors/affinity.py); "load": the fewest outstanding tokens.
    routers: router processes splitting the request path, each with its share of the workers and of the requests
        (by session id or prompt); the first coordinates refreshes, sleep, pause and scale (actors/shards.py).
    """

    name: str = "rollout_service"
    namespace: str = "rollout_service"
    engine: EngineConfig = field(default_factory=EngineConfig)
    num_workers: Any = 2
    resources: WorkerResources = field(default_factory=WorkerResources)
    placement: Placement = field(default_factory=Placement)
    sampling: dict = field(default_factory=dict)
    max_staleness: int | None = None
    max_restarts: int = 3
    max_concurrency: int = 16
    detached: bool = False
    address: str | None = None
    prompts: str | None = None
    num_prompts: int | None = None
    output: str | None = None
    apply_chat_template: bool = True
    colocate: bool = False
    client_lease_s: float = 60.0
    reward: str | None = None
    reward_workers: int = 0
    user_code_timeout_s: float = 300.0
    refresh_stall_s: float = 300.0
    routing: str = "prefix"
    routers: int = 1

    def __post_init__(self) -> None:
        c = "ServiceConfig"
        for sub, typ in (("engine", EngineConfig), ("resources", WorkerResources), ("placement", Placement)):
            v = getattr(self, sub)
            if isinstance(v, dict):
                setattr(self, sub, from_mapping(typ, v, f"{c}.{sub}"))
            elif not isinstance(v, typ):
                _fail(c, sub, v, f"must be a mapping or a {typ.__name__}")
        if not isinstance(self.name, str) or not self.name:
            _fail(c, "name", self.name, "must be a non-empty string")
        if not isinstance(self.namespace, str) or not self.namespace:
            _fail(c, "namespace", self.namespace, "must be a non-empty string")
        if self.num_workers != "auto" and (not is_int(self.num_workers) or self.num_workers < 1):
            _fail(c, "num_workers", self.num_workers, "must be 'auto' or an int >= 1")
        if self.max_staleness is not None and (not is_int(self.max_staleness) or self.max_staleness < 0):
            _fail(c, "max_staleness", self.max_staleness, "must be None or an int >= 0")
        for name, lo in (("max_restarts", -1), ("max_concurrency", 2)):
            if not is_int(getattr(self, name)) or getattr(self, name) < lo:
                _fail(c, name, getattr(self, name), f"must be an int >= {lo}")
        if self.num_prompts is not None and (not is_int(self.num_prompts) or self.num_prompts < 1):
            _fail(c, "num_prompts", self.num_prompts, "must be None or an int >= 1")
        for name in ("detached", "apply_chat_template", "colocate"):
            if not isinstance(getattr(self, name), bool):
                _fail(c, name, getattr(self, name), "must be true or false")
        for name in ("client_lease_s", "user_code_timeout_s", "refresh_stall_s"):
            if not is_number(getattr(self, name)) or not getattr(self, name) > 0:
                _fail(c, name, getattr(self, name), "must be a number > 0")
        for name in ("address", "prompts", "output"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                _fail(c, name, getattr(self, name), "must be a string or null")
        most = self.num_workers if is_int(self.num_workers) else 2**20  # ("auto": checked once resolved)
        if not is_int(self.routers) or not 1 <= self.routers <= most:
            _fail(c, "routers", self.routers, f"must be an int in [1, num_workers={self.num_workers}]")
        if self.routing not in ROUTINGS:
            _fail(c, "routing", self.routing, f"must be one of {ROUTINGS}")
        if not is_int(self.reward_workers) or self.reward_workers < 0:
            _fail(c, "reward_workers", self.reward_workers, "must be an int >= 0")
        if self.reward is not None:
            from rollout_service.rewards.functions import resolve
            resolve(self.reward, f"{c}.reward")
        self.sampling_params()  # validates the defaults now, not at the first request

    def sampling_params(self, **overrides: Any):
        from rollout_service.api.types import SamplingParams
        if not isinstance(self.sampling, dict):
            _fail("ServiceConfig", "sampling", self.sampling, "must be a mapping of SamplingParams fields")
        try:
            return SamplingParams.from_dict({**self.sampling, **overrides})
        except ValueError as e:
            raise ValueError(f"ServiceConfig.sampling: {e}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["engine"] = self.engine.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ServiceConfig":
        return from_mapping(cls, d, "service config")

    @classmethod
    def from_yaml(cls, path: str) -> "ServiceConfig":
        import yaml
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
        except OSError as e:
            raise ValueError(f"service config {path!r}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"service config {path!r}: invalid YAML ({e})") from None
        where = f"service config {path!r}"
        if d is None:  # most likely the wrong file: running on every default would hide that
            raise ValueError(f"{where} is empty: write the settings you mean (cluster_configs/local-cpu.yaml is one)")
        try:
            return from_mapping(cls, d, where)
        except ValueError as e:  # a nested section's error names the section, not the file
            raise ValueError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None

    @classmethod
    def load(cls, config: "str | dict | ServiceConfig | None" = None, **overrides: Any) -> "ServiceConfig":
        """A YAML path, a mapping or a ServiceConfig, with keyword overrides merged in (mappings such
        as `engine={"max_num_seqs": 8}` are merged key by key, not replaced)."""
        if config is None:
            base: dict = {}
        elif isinstance(config, ServiceConfig):
            base = asdict(config)
            base["engine"] = asdict(config.engine)  # keep a live model object as is
        elif isinstance(config, dict):
            base = dict(config)
        elif isinstance(config, str):
            base = asdict(cls.from_yaml(config))
        else:
            raise ValueError(f"service config: expected a YAML path, a mapping or a ServiceConfig, got {type(config).__name__}")
        return cls.from_dict(_merge(base, overrides))


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
