"""τ on the canary probes (`engine/speculation/canary.py`), recorded with every version the daemon
registers (`tau_canary`), so that each engine can tell, right after it swaps the version in, whether
it drafts there as it did here.

The target answers the probes greedily once (`LLMEngine.generate`, no drafter); the drafter is then
replayed over those answers as engines serve it by default (`DEFAULT_LEARNED_KIND`), at its own
block size, with no suffix cache (engines run the probes without theirs). Greedy serving commits
exactly what the replay counts; engines serving another kind do not judge the canary.

Not here: the probes and the judgement (the engine's), the registry tag (`daemon/retrain/run.py`).
"""

from pathlib import Path

from specloop.daemon.evaluation.replay import replay
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.build import build_proposer
from specloop.engine.speculation.canary import PROBE_TOKENS, probe_prompts
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.kinds import DEFAULT_LEARNED_KIND
from specloop.storage.sequences import TokenSequence


def probe_answers(target: LoadedModel) -> list[TokenSequence]:
    """The target's greedy answers to the probes, as an engine serving it would give them."""
    prompts = probe_prompts(target.tokenizer)
    config = EngineConfig(num_slots=len(prompts), max_len=max(map(len, prompts)) + PROBE_TOKENS + 1)
    engine = LLMEngine(target.model, config, target.tokenizer.eos_token_ids)
    done = engine.generate(prompts, SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0))
    return [TokenSequence(tuple(s.prompt_ids), tuple(s.output_ids)) for s in done]


def canary_tau(target: LoadedModel, artifact: Path, answers: list[TokenSequence] | None = None) -> float:
    """τ of the drafter in `artifact`, served by default, replayed over the probes' answers."""
    drafter = load_drafter(artifact, target.fingerprint, target.model.device, target.model.dtype).drafter
    proposer = build_proposer(DEFAULT_LEARNED_KIND, target.model, drafter)
    return replay(proposer, answers or probe_answers(target), target.model).tau
