"""Following the registry: the engine drafts with its base model's `champion` drafter, swapped live.

A thread asks the registry (`storage/registry.py`) for the alias every `poll_s` seconds, and at once
when `check()` is called (the admin endpoint). A version it has not served or refused is
downloaded, then checked in stages, each with the reason a refusal is counted under:

| stage | refused as | what is checked |
| --- | --- | --- |
| download | `download` | the version's artifact exists and has both files |
| `drafter.json` | `fingerprint` | the drafter was trained for the served base model |
| `drafter.json` | `config` | it fits this target (widths, vocabulary, depth, taps) and the engine's longest block |
| weights | `weights` | the safetensors load into that architecture, every value finite |
| propose | `propose` | on the engine thread: one propose on a real context gives finite draft logits |
| canary | `canary` | serving, it drafts the canary probes nearly as well as when it was registered |
| any | `error` | anything else that raised: a bug, or a version no check foresaw |

The canary (`engine/speculation/canary.py`) runs right after the swap: the probe prompts go through
the engine greedily, drafted by the new version, and their pooled τ is held against the version's
`tau_canary` tag. A version that fails is swapped back at once to the drafter it replaced (rebuilt
from the registry, or n-gram lookup alone), refused like any other, and its τ is exported as
`specloop_drafter_canary_tau{result="fail"}`, which the daemon reads to roll the alias back. A
version without the tag (the seeded shipped drafter) is not judged, and the log says so.

A version is untrusted input: the download is bounded by the most a drafter of the served target
can hold, every dimension of its config by the target's before anything is allocated, and its
weights file by what that config implies. Nothing a version holds can end the follower's thread: an
unexpected exception refuses the version like any check, and one in the loop itself is logged,
counted (`error`) and retried with backoff.

The new proposer is built here, beside the serving one; the last stage runs inside the swap
(`LLMEngine.swap`), on the engine thread between two steps: allocate its per-slot state, probe it,
serve new sequences with it from the next step. Running sequences finish with the drafter they
started with. The probe's context goes through the target once, at the first swap, and its hidden
states are kept (a few kB), so later swaps hold the engine thread for the drafter's work only
(22.5 ms, a tenth of an engine step, in benchmarks/drafter_swap.py). A refused version is logged
once, counted, and not tried again until the alias moves; the drafter serving keeps serving. When the
registry cannot be reached, serving goes on and the thread retries with backoff (1 s, doubling to
60 s), logging the outage once and the recovery once.

A champion is **benched** while the daemon's newest contest found it + suffix decoding less than the
policy's margin faster than suffix decoding alone (its `benched` tag is "true";
`daemon/retrain/contest.py`): new sequences draft with suffix decoding alone (`drafter_version`
none) and the alias stays, so the next contest judges it again and a later "false" swaps it back in
through every check above. Only an engine serving the default kind (`dflash+suffix`) benches: the
contest measures nothing else. A version no contest has judged yet (the seeded shipped drafter) serves.

Not here: the registry's names and tags (`storage/registry.py`), the engine's swap mechanics
(`engine/runtime/llm_engine.py`), HTTP (`engine/server/`).
"""

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import LLMEngine
from specloop.engine.runtime.sequence import SamplingParams, SpecStats
from specloop.engine.speculation import canary
from specloop.engine.speculation.build import build_proposer, dflash_of
from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter
from specloop.engine.speculation.drafter_artifact import WEIGHTS, max_artifact_bytes, read_meta, weight_bytes
from specloop.engine.speculation.kinds import DEFAULT_LEARNED_KIND, LEARNED_KINDS, ProposerKind, lookup_kind
from specloop.engine.speculation.proposer import Proposer, ServedDrafter
from specloop.engine.speculation.suffix_cache import SuffixCache
from specloop.storage.registry import DrafterRegistry, DrafterVersion, RegistryUnavailable, Tag

log = logging.getLogger(__name__)

REASONS = ("download", "fingerprint", "config", "weights", "propose", "canary", "error")
_BACKOFF_S = (1.0, 60.0)  # first retry, longest wait while the registry is unreachable
_SWAP_TIMEOUT_S = 120.0  # the engine applies a swap between steps; a step takes milliseconds


class DrafterRefused(ValueError):
    """A drafter version that must not serve, with the reason it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CheckResult:
    """What one look at the alias did: `swapped`, `unchanged`, `refused`, `benched`, `no_champion` or
    `unavailable`."""

    result: str
    serving: str | None  # the version new sequences draft with after this check
    champion: str | None = None  # the alias's version, when the registry answered
    reason: str | None = None  # why it was refused
    detail: str | None = None


# Called once per swap attempt with ("ok", None) or ("refused", reason).
SwapRecorder = Callable[[str, str | None], None]
# Called once per canary run with (version, live τ, passed).
CanaryRecorder = Callable[[str, float, bool], None]


def check_artifact(path: Path, fingerprint: str, target: Transformer, max_block_size: int) -> DFlashDrafter:
    """The drafter in artifact `path`, on the target's device and dtype, or `DrafterRefused` saying why not."""
    try:
        meta = read_meta(path)
        config = DFlashConfig.from_json(meta["config"])
        trained_for = meta["base_model_fingerprint"]
    except (ValueError, KeyError, TypeError) as e:
        raise DrafterRefused("config", f"drafter {path}: unreadable drafter.json ({e})") from e
    if trained_for != fingerprint:
        raise DrafterRefused("fingerprint", f"drafter {path} was trained for base model {trained_for}, "
                                            f"the served model is {fingerprint}")
    try:
        config.check_target(target.config)
    except ValueError as e:
        raise DrafterRefused("config", f"drafter {path} does not fit the target: {e}") from e
    if config.block_size > max_block_size:
        raise DrafterRefused("config", f"drafter {path}: block size {config.block_size} exceeds the engine's "
                                       f"max_block_size {max_block_size}")
    weights, most = Path(path) / WEIGHTS, weight_bytes(config)
    if weights.stat().st_size > most:
        raise DrafterRefused("weights", f"drafter {path}: {WEIGHTS} has {weights.stat().st_size} bytes, more than "
                                        f"its config's tensors can hold ({most})")
    drafter = DFlashDrafter(config)
    try:
        drafter.load_state_dict(load_file(weights), strict=True)
    except Exception as e:  # safetensors' own error types, shape mismatches, missing or extra tensors
        raise DrafterRefused("weights", f"drafter {path}: weights do not load: {e}") from e
    if not all(torch.isfinite(p).all() for p in drafter.parameters()):
        raise DrafterRefused("weights", f"drafter {path}: weights hold NaN or infinite values")
    return drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


class ProbeContext:
    """A real context for `probe`: token ids and, once computed, the target's output at every layer."""

    def __init__(self, target: Transformer, tokens: list[int]) -> None:
        assert len(tokens) >= 2
        self.target = target
        self.ids = torch.tensor([tokens], device=target.device)  # [1, n]
        self._layers: list[torch.Tensor] | None = None  # [1, n, H] per target layer

    def taps(self, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The target's outputs at `layers`; the first call runs the target (cache-less: the engine's
        KV cache is not touched), so call it on the engine thread."""
        if self._layers is None:
            with torch.no_grad():
                _, self._layers = self.target(self.ids, taps=range(self.target.config.num_layers))
        return [self._layers[i] for i in layers]


def probe(drafter: ServedDrafter, context: ProbeContext) -> None:
    """One propose on a real context: finite draft logits, or refused.

    It writes slot 0 of the new proposer, which serves nothing yet; the slot's next owner overwrites it.
    """
    dflash = dflash_of(drafter.proposer)
    assert dflash is not None
    with torch.no_grad():
        dflash.observe([0], [0], context.taps(dflash.tap_layers), context.ids)
        logits = dflash.block_logits([0], [context.ids.shape[1]], context.ids[0, -1:])
    if not torch.isfinite(logits).all():
        raise DrafterRefused("propose", f"drafter {drafter.version}: a propose gave non-finite draft logits")


class DrafterFollower:
    """Keeps `engine` drafting with the `champion` of `fingerprint` in `registry`. Thread-safe."""

    def __init__(self, registry: DrafterRegistry, engine: LLMEngine, target: Transformer, fingerprint: str,
                 kind: ProposerKind, probe_tokens: list[int], cache_dir: Path, poll_s: float = 30.0,
                 block_size: int | None = None, record_swap: SwapRecorder | None = None,
                 canary_prompts: list[list[int]] = (), record_canary: CanaryRecorder | None = None,
                 suffix_cache: SuffixCache | None = None) -> None:
        if poll_s <= 0:
            raise ValueError(f"registry poll interval must be > 0 s, got {poll_s}")
        if kind not in LEARNED_KINDS:
            raise ValueError(f"following a drafter registry needs a proposer with a drafter "
                             f"({', '.join(LEARNED_KINDS)}), not {kind}")
        self.registry, self.engine, self.target, self.fingerprint = registry, engine, target, fingerprint
        self.kind, self.block_size, self.suffix_cache = kind, block_size, suffix_cache
        self.probe_context = ProbeContext(target, probe_tokens)
        self.cache_dir, self.poll_s = cache_dir, poll_s
        self.record_swap = record_swap or (lambda result, reason: None)
        self.canary_prompts, self.record_canary = list(canary_prompts), record_canary or (lambda *_: None)
        self._refused: str | None = None  # the version refused last; tried again only once the alias moves
        self._benched: str | None = None  # the champion benched last, while lookup alone drafts
        self._lock = threading.Lock()  # one check at a time: the poll thread's or the admin endpoint's
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outage = 0  # consecutive failed lookups
        self._no_champion_said = False  # logged since the alias was last seen empty

    def start(self) -> None:
        assert self._thread is None, "follower already started"
        self._thread = threading.Thread(target=self._run, name="drafter-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=_SWAP_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                result = self.check()
            except Exception as e:  # a bug: this thread is how the engine follows promotions and rollbacks
                log.exception("drafter follower: a check failed; trying again with backoff")
                self.record_swap("refused", "error")
                result = self._unavailable(e)
            wait = self.poll_s if result.result != "unavailable" else self._backoff_s()
            self._wake.wait(wait)
            self._wake.clear()

    def _backoff_s(self) -> float:
        first, longest = _BACKOFF_S
        return min(longest, first * 2 ** (self._outage - 1))

    def check(self) -> CheckResult:
        """Look at the alias now and swap to a new champion that passes every check."""
        with self._lock:
            try:
                champion = self.registry.champion(self.fingerprint)
            except RegistryUnavailable as e:
                return self._unavailable(e)
            self._recovered()
            serving = self.engine.drafter_version
            if champion is None:
                self._say_no_champion()
                return CheckResult("no_champion", serving)
            self._no_champion_said = False
            if self._slower_than_lookup(champion):
                return self._bench(champion)
            if champion.label == serving:
                return CheckResult("unchanged", serving, champion.label)
            if champion.label == self._refused:
                return CheckResult("refused", serving, champion.label, detail="refused before; waiting for the "
                                                                                 "alias to move")
            return self._swap_to(champion)

    def _say_no_champion(self) -> None:
        """Once per stretch without a champion: until the daemon trains one, lookup proposers draft alone."""
        if not self._no_champion_said:
            self._no_champion_said = True
            log.warning("no drafter is champion of base model %s yet: lookup proposers draft alone until the "
                        "retraining daemon registers one", self.fingerprint)

    def _slower_than_lookup(self, champion: DrafterVersion) -> bool:
        """Whether the daemon's newest contest benched `champion`. Only the default kind is judged: the
        contest replays nothing else."""
        return self.kind == DEFAULT_LEARNED_KIND and champion.benched

    def _bench(self, champion: DrafterVersion) -> CheckResult:
        """Draft with the lookup half alone while the champion is benched; its alias stays where it is."""
        gain = champion.speed_over_suffix
        detail = (f"{champion.label} + suffix decoding modelled {'?' if gain is None else f'{gain:+.1%}'} against "
                  f"suffix decoding alone in the daemon's newest contest, short of its margin; suffix decoding "
                  f"drafts alone")
        if self._benched == champion.label and self.engine.drafter_version is None:
            return CheckResult("benched", None, champion.label, detail=detail)
        try:
            self.engine.swap(self._lookup_only).result(timeout=_SWAP_TIMEOUT_S)
        except Exception as e:  # no step came, or the build raised on the engine thread: try at the next look
            log.warning("drafter %s: benching it failed (%s: %s); %s keeps serving", champion.label,
                        type(e).__name__, e, self.engine.drafter_version or "no drafter")
            return CheckResult("unchanged", self.engine.drafter_version, champion.label, detail=str(e))
        self._benched = champion.label
        log.warning("drafter %s benched: %s", champion.label, detail)
        return CheckResult("benched", None, champion.label, detail=detail)

    def _swap_to(self, champion: DrafterVersion) -> CheckResult:
        previous = self.engine.drafter_version
        try:
            path = self.registry.download(champion, self.cache_dir, max_artifact_bytes(self.target.config))
        except RegistryUnavailable as e:
            return self._unavailable(e)
        except (ValueError, OSError) as e:
            return self._refuse(champion, DrafterRefused("download", f"drafter {champion.label}: {e}"))
        try:
            drafter = check_artifact(path, self.fingerprint, self.target, self.engine.config.max_block_size)
            proposer = self._proposer(drafter, champion.label)
            swap = self.engine.swap(self._build(proposer, champion.label))
        except DrafterRefused as e:
            return self._refuse(champion, e)
        except Exception as e:  # nothing a version holds may stop the follower; it is refused like any other
            return self._refuse(champion, DrafterRefused("error", f"drafter {champion.label}: {type(e).__name__}: {e}"))
        try:
            served = swap.result(timeout=_SWAP_TIMEOUT_S)
        except DrafterRefused as e:
            return self._refuse(champion, e)
        except Exception as e:
            if isinstance(e, TimeoutError) or not self.engine.alive:  # no step came: try at the next look
                return CheckResult("unchanged", self.engine.drafter_version, champion.label, detail=str(e))
            # The build raised on the engine thread (allocation, the probe): the serving drafter kept serving.
            return self._refuse(champion, DrafterRefused("error", f"drafter {champion.label}: {type(e).__name__}: {e}"))
        self.record_swap("ok", None)
        log.info("drafter %s of %s serving new sequences (%s)", champion.label, self.fingerprint, self.kind)
        failure = self._canary(champion)
        if failure is not None:
            refused = self._refuse(champion, DrafterRefused("canary", f"drafter {champion.label}: {failure}"))
            self._restore(previous)
            return dataclasses.replace(refused, serving=self.engine.drafter_version)
        return CheckResult("swapped", served.version if served else None, champion.label)

    def _canary(self, champion: DrafterVersion) -> str | None:
        """Why the version now serving failed its canary, or None (passed, or no τ to judge it by)."""
        promoted = champion.tags.get(Tag.TAU_CANARY)
        if promoted is None or not self.canary_prompts:
            log.info("drafter %s: no canary τ recorded with it; its canary is not judged", champion.label)
            return None
        if self.kind != DEFAULT_LEARNED_KIND:  # the tag's τ is the default kind's: another kind drafts otherwise
            log.info("drafter %s: its canary τ is %s's, this engine serves %s; not judged", champion.label,
                     DEFAULT_LEARNED_KIND, self.kind)
            return None
        live = self._probe_tau()
        failure = canary.judge(live, float(promoted))
        self.record_canary(champion.label, live, failure is None)
        log.log(logging.ERROR if failure else logging.INFO, "drafter %s canary: live τ %.3f, %.3f when registered",
                champion.label, live, float(promoted))
        return failure

    def _probe_tau(self) -> float:
        """The canary probes through the engine, greedy, one at a time (a batch would cap how far each may
        draft: `engine/runtime/verify_cost.py`), every draft verified: their pooled τ."""
        params = SamplingParams(max_tokens=canary.PROBE_TOKENS, temperature=0.0, verify_all_drafts=True)

        async def answer(prompt: list[int]) -> SpecStats | None:
            last = None
            async for delta in self.engine.stream(prompt, params, suffix_cache=False):  # the probes' own earlier
                # answers in a suffix cache would pass any drafter
                last = delta
            return last.spec if last is not None else None

        async def each() -> list[SpecStats | None]:
            return [await answer(p) for p in self.canary_prompts]

        async def every() -> list[SpecStats | None]:
            return await asyncio.wait_for(each(), _SWAP_TIMEOUT_S)

        return SpecStats.pooled(s for s in asyncio.run(every()) if s is not None).mean_accepted_length

    def _restore(self, label: str | None) -> None:
        """Serve `label` again (the drafter a failed version replaced), or n-gram lookup alone when it
        cannot be rebuilt; the canary is not run on it again."""
        try:
            if label is not None:
                version = self.registry.version(self.fingerprint, label.removeprefix("v"))
                path = self.registry.download(version, self.cache_dir, max_artifact_bytes(self.target.config))
                drafter = check_artifact(path, self.fingerprint, self.target, self.engine.config.max_block_size)
                self.engine.swap(self._build(self._proposer(drafter, label), label)).result(timeout=_SWAP_TIMEOUT_S)
                log.warning("drafter %s serving again", label)
                return
        except Exception:  # the registry is down, the version gone: lookup alone is always safe
            log.exception("drafter %s could not be served again; n-gram lookup alone drafts", label)
        self.engine.swap(self._lookup_only).result(timeout=_SWAP_TIMEOUT_S)

    def _lookup_only(self, num_slots: int, positions: int) -> ServedDrafter | None:
        lookup = lookup_kind(self.kind)
        if lookup is None:
            return None
        proposer = build_proposer(lookup, self.target, block_size=self.block_size, suffix_cache=self.suffix_cache,
                                  max_block_size=self.engine.config.max_block_size)
        proposer.allocate(num_slots, positions)
        return ServedDrafter(proposer, None)

    def _proposer(self, drafter: DFlashDrafter, version: str) -> Proposer:
        """Built on this thread, beside the serving proposer (weight packing for the CPU kernels
        included), so the swap itself holds the engine thread only for allocation and the probe."""
        try:
            return build_proposer(self.kind, self.target, drafter, self.block_size, self.suffix_cache,
                                  self.engine.config.max_block_size)
        except ValueError as e:
            raise DrafterRefused("config", f"drafter {version}: {e}") from e

    def _build(self, proposer: Proposer, version: str) -> Callable[[int, int], ServedDrafter]:
        def build(num_slots: int, positions: int) -> ServedDrafter:
            proposer.allocate(num_slots, positions)
            served = ServedDrafter(proposer, version)
            probe(served, self.probe_context)
            return served
        return build

    def _refuse(self, champion: DrafterVersion, refusal: DrafterRefused) -> CheckResult:
        self._refused = champion.label
        self.record_swap("refused", refusal.reason)
        log.error("drafter %s refused (%s): %s; %s keeps serving", champion.label, refusal.reason, refusal,
                  self.engine.drafter_version or "no drafter")
        return CheckResult("refused", self.engine.drafter_version, champion.label, refusal.reason, str(refusal))

    def _unavailable(self, error: Exception) -> CheckResult:
        self._outage += 1
        if self._outage == 1:
            log.warning("drafter registry unreachable (%s); serving goes on with %s, retrying with backoff",
                        error, self.engine.drafter_version or "no drafter")
        return CheckResult("unavailable", self.engine.drafter_version, detail=str(error))

    def _recovered(self) -> None:
        if self._outage:
            log.info("drafter registry reachable again after %d failed lookups", self._outage)
        self._outage = 0


def probe_text_tokens(encode: Callable[[str], list[int]]) -> list[int]:
    """A fixed, real context for `probe`: a sentence through the served tokenizer."""
    tokens = encode("Speculative decoding drafts several tokens, and the target model checks them in one pass.")
    assert len(tokens) >= 2
    return tokens
