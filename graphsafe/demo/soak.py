"""`python -m graphsafe soak`: the demo model under load, long enough for leaks to show.

N decode steps (default 10,000 on a GPU) of the demo model replayed from CUDA graphs
(`graphsafe.graphs.GraphRunner`, one graph per batch bucket), in episodes: each episode
is a batch of fresh requests of random prompt lengths (its batch size drawn anew, every
bucket reached), prefilled, then decoded for a random number of steps, so the batch size
changes from episode to episode and the context lengths with every step. While an
episode decodes on the current stream, the next episode's prefill runs on a second
CUDA stream in workspace lane 1 (its own arena), over cache blocks of its own: the two
states hand out disjoint halves of the caches' blocks.

Reported: the steps run, memory (CUDA: `torch.cuda.memory_allocated` / `_reserved`) at the
start of the second episode and after the last, which must be equal; caching-allocator
allocations and host syncs per decode step (0: a step is a metadata build into the
graphs' static buffers, a replay and host bookkeeping); the workspace arenas of both lanes
(locked: no growth); and whether the replays' outputs equal an eager rerun: a few
episodes (the first, the last, some between) are run again after the soak, alone (no
overlapping prefill), fed the same tokens, the step called outside any graph on the same
padded bucket rows; its picks must equal the replays' at every step and its logits bit
for bit at sampled steps.

Without CUDA (CI's CPU) there are no graphs and no second stream: the runner emulates the
graphs (the step re-run on the bucket's static rows) and each prefill runs before the
decode it would overlap, still in lane 1; memory is the process's resident set
(informative: no caching allocator to count). The output says so.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from graphsafe.demo.measure import Progress, _batch_dim_not_specialised, _Counters
from graphsafe.demo.options import DemoError, check_model_overrides
from graphsafe.demo.table import _device_name

MIB = 1 << 20


@dataclass
class SoakOptions:
    device: str = "cpu"
    steps: int = 48
    max_batch: int = 4
    max_prompt: int = 24  # above the demo model's index_topk (16): sparse prefill too
    min_decode: int = 4  # decode steps of an episode: drawn in [min_decode, max_decode]
    max_decode: int = 8
    checks: int = 3  # episodes rerun eagerly and compared
    seed: int = 0
    compile: bool = False  # capture torch.compile(fullgraph=True, dynamic=True) of the step
    backend: str = "inductor"
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    threads: int = 1  # CPU intra-op threads (restored after); 0 leaves torch's setting
    progress: bool = True
    model_overrides: dict[str, Any] = field(default_factory=dict)


def default_soak_options(device: str) -> SoakOptions:
    """10,000 steps on a GPU (B up to 64, prompts up to 256 tokens, 16 to 128 steps an
    episode); a small run on a CPU (CI: about 30 s on 2 cores)."""
    if device == "cuda":
        return SoakOptions(device="cuda", steps=10_000, max_batch=64, max_prompt=256, min_decode=16, max_decode=128,
                           checks=5)
    return SoakOptions()


@dataclass
class Episode:
    batch: int
    prompts: list[list[int]]
    steps: int


@dataclass
class SoakResult:
    device: str
    graphs: bool  # CUDA graphs replayed (else emulated)
    streams: int  # 2: prefill overlapped decode on a second stream
    steps: int = 0
    episodes: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    replays_per_bucket: dict[int, int] = field(default_factory=dict)
    context_min: int = 0
    context_max: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    prefills_in_flight: int = 0  # still running on the second stream when decode went on
    seconds: float = 0.0
    memory_start: dict[str, int] = field(default_factory=dict)
    memory_end: dict[str, int] = field(default_factory=dict)
    workspace_start: dict[int, tuple[int, int]] = field(default_factory=dict)  # lane -> (bytes, grows)
    workspace_end: dict[int, tuple[int, int]] = field(default_factory=dict)
    allocations: int | None = None  # in all decode steps (CUDA)
    syncs: int | None = None
    checked_episodes: int = 0
    checked_steps: int = 0
    checked_logits: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def memory_flat(self) -> bool:
        key = "allocated" if self.graphs else None
        return key is None or self.memory_start.get(key) == self.memory_end.get(key)

    @property
    def workspace_flat(self) -> bool:
        return self.workspace_start == self.workspace_end

    @property
    def ok(self) -> bool:
        return (not self.mismatches and self.memory_flat and self.workspace_flat and self.checked_steps > 0
                and (self.allocations in (None, 0)) and (self.syncs in (None, 0)))


def _plan(opts: SoakOptions, vocab: int) -> list[Episode]:
    """Episodes until `opts.steps` decode steps: the first at the largest batch and prompt
    (the allocator and the arenas meet the worst case first), then every bucket's size and
    the size above it once (shuffled), then random batch sizes (half of them such an
    edge), prompt lengths and step counts."""
    rng = random.Random(opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    from graphsafe.graphs import buckets_up_to

    edges = sorted({x for b in buckets_up_to(opts.max_batch) for x in (b, b + 1) if x <= opts.max_batch})
    order = rng.sample(edges, len(edges))
    episodes: list[Episode] = []
    left = opts.steps
    while left > 0:
        first = not episodes
        if first:
            batch = opts.max_batch
        elif len(episodes) <= len(order):
            batch = order[len(episodes) - 1]
        else:
            batch = rng.choice(edges) if rng.random() < 0.5 else rng.randint(1, opts.max_batch)
        lengths = [opts.max_prompt if first else rng.randint(1, opts.max_prompt) for _ in range(batch)]
        steps = min(left, rng.randint(opts.min_decode, opts.max_decode))
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
        episodes.append(Episode(batch, prompts, steps))
        left -= steps
    return episodes


def _checked(n: int, checks: int) -> list[int]:
    """`checks` episodes spread over n: the first, the last, evenly between."""
    if n <= checks:
        return list(range(n))
    return sorted({round(i * (n - 1) / (checks - 1)) for i in range(checks)}) if checks > 1 else [n - 1]


def _sampled(steps: int) -> list[int]:
    return sorted({0, steps // 2, steps - 1})


@dataclass
class _Record:
    """What a checked episode's replays produced: the tokens fed (prefill picks, then each
    step's picks) and the logits at sampled steps, in buffers allocated before the soak."""

    first: torch.Tensor  # [batch]
    picks: torch.Tensor  # [steps, batch]
    logits: torch.Tensor  # [len(sampled), batch, vocab]
    sampled: list[int]


def _memory(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}
    try:
        with open("/proc/self/statm") as f:
            return {"rss": int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}
    except (OSError, ValueError):
        return {}


def _workspaces(device: torch.device) -> dict[int, tuple[int, int]]:
    from graphsafe.workspace import current_workspace_manager, workspace_lane

    out = {}
    for lane in (0, 1):
        with workspace_lane(lane):
            s = current_workspace_manager(device).stats()
        out[lane] = (s.size_bytes, s.grow_count)
    return out


def _state_blocks(model: Any, parity: int) -> range:
    """The cache blocks of the states of episodes of this parity: one half each, so that
    an episode's prefill never writes a block the decoding episode reads."""
    half = model.num_blocks // 2
    return range(parity * half, (parity + 1) * half)


class _Soak:
    def __init__(self, opts: SoakOptions, out: TextIO) -> None:
        from graphsafe.models import build_demo_model

        self.opts, self.out = opts, out
        self.device = device = torch.device(opts.device)
        self.cuda = device.type == "cuda"
        max_len = opts.max_prompt + opts.max_decode
        max_blocks = -(-max_len // opts.block_size)
        self.model, _ = build_demo_model(
            device, dtype=opts.dtype, seed=opts.seed, with_hf=False, max_batch=opts.max_batch, max_model_len=max_len,
            block_size=opts.block_size, num_blocks=2 * opts.max_batch * max_blocks, **opts.model_overrides,
        )
        self.vocab = self.model.cfg.vocab_size
        self.plan = _plan(opts, self.vocab)
        self.side = torch.cuda.Stream(device) if self.cuda else None
        # First tokens of the episodes, written by their prefill: two buffers (an episode
        # reads one while the next episode's prefill writes the other).
        self.first = [torch.zeros(opts.max_batch, dtype=torch.int64, device=device) for _ in range(2)]
        self.result = SoakResult(device=_device_name(device), graphs=self.cuda, streams=2 if self.cuda else 1)

    def step(self, inputs):
        logits = self.model.decode_step(inputs)
        return logits, logits.argmax(-1)

    def _stream(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    @torch.no_grad()
    def prefill(self, index: int) -> tuple[Any, torch.Tensor, Any]:
        """Episode `index`'s requests prefilled on the second stream in lane 1: (state,
        first tokens, event marking the end of the prefill on that stream)."""
        from graphsafe.workspace import workspace_lane

        episode = self.plan[index]
        state = self.model.new_state(block_ids=_state_blocks(self.model, index % 2))
        first = self.first[index % 2][: episode.batch]
        event = None
        if self.side is not None:
            # After everything the current stream has queued: the previous user of these
            # blocks (two episodes ago) and of this first-token buffer is done.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        with self._stream(self.side), workspace_lane(1):
            first.copy_(self.model.prefill(state, episode.prompts).argmax(-1))
            if self.side is not None:
                event = torch.cuda.Event()
                event.record(self.side)
        self.result.prefills += 1
        self.result.prefill_tokens += sum(len(p) for p in episode.prompts)
        return state, first, event

    def capture(self):
        from graphsafe.graphs import GraphRunner, buckets_up_to
        from graphsafe.workspace import current_workspace_manager, workspace_lane

        model = self.model
        with workspace_lane(1):  # prefills run there: their worst case now, then locked
            model.prefill_workspace_reserve()
            current_workspace_manager(self.device).lock()
        self.fn = self.step
        if self.opts.compile:
            self.fn = torch.compile(self.step, fullgraph=True, dynamic=True, backend=self.opts.backend)
        buckets = buckets_up_to(self.opts.max_batch)
        static = model.decode_builder.build_for_capture(buckets[-1])
        self.runner = GraphRunner(self.fn, static, buckets=buckets, reserve=model.decode_workspace_reserve,
                                  static=static, emulate=not self.cuda)
        with _batch_dim_not_specialised():
            self.runner.capture()

    @torch.no_grad()
    def run(self) -> SoakResult:
        opts, model, res = self.opts, self.model, self.result
        self.capture()
        checked = set(_checked(len(self.plan), opts.checks))
        records: dict[int, _Record] = {}
        for e in sorted(checked):
            ep = self.plan[e]
            sampled = _sampled(ep.steps)
            records[e] = _Record(
                first=torch.empty(ep.batch, dtype=torch.int64, device=self.device),
                picks=torch.empty(ep.steps, ep.batch, dtype=torch.int64, device=self.device),
                logits=torch.empty(len(sampled), ep.batch, self.vocab, dtype=torch.float32, device=self.device),
                sampled=sampled,
            )
        counters = _Counters(self.device)
        progress = Progress(opts.steps, opts.progress)
        current = torch.cuda.current_stream(self.device) if self.cuda else None
        res.context_min = min(len(p) for ep in self.plan for p in ep.prompts) + 1
        res.context_max = max(max(len(p) for p in ep.prompts) + ep.steps for ep in self.plan)
        t0 = time.perf_counter()
        pending = self.prefill(0)
        with _batch_dim_not_specialised():
            for e, ep in enumerate(self.plan):
                state, tokens, event = pending
                if event is not None:
                    current.wait_event(event)
                if e == 1:
                    res.memory_start, res.workspace_start = _memory(self.device), _workspaces(self.device)
                record = records.get(e)
                if record is not None:
                    record.first.copy_(tokens)
                # The next episode's prefill, overlapping this one's decode.
                pending = self.prefill(e + 1) if e + 1 < len(self.plan) else None
                with counters.window():
                    for i in range(ep.steps):
                        logits, picks = self.runner(model.decode_inputs(state, tokens))
                        if record is not None:
                            record.picks[i].copy_(picks)
                            if i in record.sampled:
                                record.logits[record.sampled.index(i)].copy_(logits)
                        tokens = picks
                        model.advance(state)
                        if i == 0 and pending is not None and pending[2] is not None:
                            res.prefills_in_flight += not pending[2].query()
                        progress.update(1, f"episode {e + 1}/{len(self.plan)} B={ep.batch}")
                res.steps += ep.steps
                res.episodes += 1
                if ep.batch not in res.batch_sizes:
                    res.batch_sizes.append(ep.batch)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        res.seconds = time.perf_counter() - t0
        progress.close()
        del tokens, logits, picks, pending, state
        res.memory_end, res.workspace_end = _memory(self.device), _workspaces(self.device)
        if len(self.plan) == 1:
            res.memory_start, res.workspace_start = res.memory_end, res.workspace_end
        res.batch_sizes.sort()
        res.replays_per_bucket = dict(self.runner.stats.replays)
        if self.cuda:
            res.allocations, res.syncs = counters.allocs, counters.syncs
        try:
            self.compare(records)
        finally:
            self.close()
        return res

    @torch.no_grad()
    def compare(self, records: dict[int, _Record]) -> None:
        """Each checked episode again, alone: its prefill (lane 1, no second stream), then
        its steps fed the soak's tokens, the step called outside any graph on the same
        padded bucket rows. Picks equal at every step, logits bit for bit where sampled."""
        from graphsafe.workspace import workspace_lane

        model, res = self.model, self.result
        with _batch_dim_not_specialised():
            for e, record in records.items():
                ep = self.plan[e]
                n = ep.batch
                state = model.new_state(block_ids=_state_blocks(model, e % 2))
                with workspace_lane(1):
                    first = model.prefill(state, ep.prompts).argmax(-1)
                if not torch.equal(first, record.first):
                    res.mismatches.append(f"episode {e} (B={n}): the prefill's picks differ")
                rows = self.runner.static_inputs(self.runner.bucket_for(n))
                tokens = record.first
                for i in range(ep.steps):
                    model.decode_inputs(state, tokens)  # into the builder's buffers: the bucket's rows
                    logits, picks = self.fn(rows)
                    if not torch.equal(picks[:n], record.picks[i]):
                        res.mismatches.append(f"episode {e} (B={n}) step {i}: picks differ from the replay's")
                    if i in record.sampled:
                        got, want = logits[:n], record.logits[record.sampled.index(i)]
                        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                            diff = (got - want).abs().max().item()
                            res.mismatches.append(f"episode {e} (B={n}) step {i}: logits differ (max |diff| {diff:g})")
                        res.checked_logits += 1
                    tokens = record.picks[i]
                    model.advance(state)
                    res.checked_steps += 1
                res.checked_episodes += 1

    def close(self) -> None:
        from graphsafe.workspace import current_workspace_manager, workspace_lane

        self.runner.close()
        with workspace_lane(1):
            current_workspace_manager(self.device).unlock()


def _validate(opts: SoakOptions) -> None:
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: no CUDA device here")
    if opts.steps < 1 or opts.max_batch < 1 or opts.max_prompt < 1 or not 1 <= opts.min_decode <= opts.max_decode:
        raise DemoError("steps, the batch size, the prompt length and the decode steps (min <= max) must be positive")
    if opts.checks < 1:
        raise DemoError(f"--checks: at least one episode is compared with an eager rerun, got {opts.checks}")
    check_model_overrides(opts.model_overrides)
    sized = sorted(set(opts.model_overrides) & {"max_batch", "max_model_len", "block_size", "num_blocks"})
    if sized:
        raise DemoError(f"--model {sized[0]}: the soak sizes the model from --max-batch, --max-prompt and "
                        f"--decode (two states' worth of cache blocks)")


def run_soak(opts: SoakOptions, out: TextIO | None = None) -> SoakResult:
    """Run the soak, print its report to `out`, return the figures."""
    out = out or sys.stdout
    _validate(opts)
    previous_threads = torch.get_num_threads()
    if opts.device == "cpu" and opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        result = _Soak(opts, out).run()
    finally:
        torch.set_num_threads(previous_threads)
    print(format_soak(result, opts), file=out)
    return result


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def format_soak(r: SoakResult, opts: SoakOptions) -> str:
    mode = "torch.compile(fullgraph=True, dynamic=True) step" if opts.compile else "eager step"
    buckets = ", ".join(f"{b}: {n}" for b, n in sorted(r.replays_per_bucket.items()))
    lines = [f"graphsafe soak on {r.device}: {r.steps} decode steps in {r.episodes} episodes, {r.seconds:.1f} s "
             f"({r.steps / max(r.seconds, 1e-9):.0f} steps/s)"]
    if r.graphs:
        lines.append(f"  graphs: the {mode} captured per bucket; replays per bucket {{{buckets}}}")
    else:
        lines.append(f"  no CUDA: no graphs (GraphRunner emulates them: the {mode} re-run on the bucket's static "
                     f"rows; runs per bucket {{{buckets}}}) and no second stream (each prefill runs before the decode "
                     f"it would overlap, in its own workspace lane)")
    lines.append(f"  decode: batch sizes {_ranges(r.batch_sizes)}, contexts {r.context_min}..{r.context_max} tokens")
    overlap = (f"on a second stream, workspace lane 1; {r.prefills_in_flight} of {max(r.prefills - 1, 0)} still "
               f"running when the decode beside them had been queued" if r.streams == 2 else "in workspace lane 1")
    lines.append(f"  prefill: {r.prefills} prefills, {r.prefill_tokens} tokens, {overlap}")
    if r.graphs:
        lines.append(f"  memory: allocated {_mib(r.memory_start['allocated'])} at the start (episode 2), "
                     f"{_mib(r.memory_end['allocated'])} at the end ({'flat' if r.memory_flat else 'GREW'}); reserved "
                     f"{_mib(r.memory_start['reserved'])}, {_mib(r.memory_end['reserved'])}")
        lines.append(f"  allocations: {r.allocations / max(r.steps, 1):g} per decode step ({r.allocations} in "
                     f"{r.steps}); host syncs: {r.syncs / max(r.steps, 1):g} per step ({r.syncs})")
    else:
        rss = (f"{_mib(r.memory_start['rss'])} at the start (episode 2), {_mib(r.memory_end['rss'])} at the end"
               if "rss" in r.memory_start and "rss" in r.memory_end else "n/a")
        lines.append(f"  memory: resident set {rss} (no caching allocator on a CPU: informative); allocations "
                     f"and syncs per step: n/a (CUDA only)")
    ws = "; ".join(f"lane {lane} {_mib(r.workspace_end[lane][0])} ({r.workspace_end[lane][1] - r.workspace_start[lane][1]} "
                   f"growths)" for lane in sorted(r.workspace_end))
    lines.append(f"  workspace: {ws} ({'flat' if r.workspace_flat else 'GREW'})")
    verdict = "equal" if not r.mismatches else f"{len(r.mismatches)} MISMATCHES: " + "; ".join(r.mismatches[:3])
    lines.append(f"  outputs vs an eager rerun: {r.checked_episodes} episodes, picks at {r.checked_steps} steps, "
                 f"logits bit for bit at {r.checked_logits} sampled steps: {verdict}")
    lines.append(f"result: {'ok' if r.ok else 'FAILED'}")
    return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if len(values) <= 12 else f"{len(values)} sizes in {values[0]}..{values[-1]}"


def write_json(result: SoakResult, path: str) -> None:
    data = asdict(result)
    data.update(ok=result.ok, memory_flat=result.memory_flat, workspace_flat=result.workspace_flat)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
