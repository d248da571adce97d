"""Tiny random target models and drafters shared by the DFlash tests (seconds on a CPU), the
target's greedy answers as stored data, and greedy decoding with and without a proposer side by side."""

import torch

from specloop.engine.model.config import ModelConfig
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams, Sequence
from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter
from specloop.engine.speculation.proposer import Proposer
from specloop.storage.sequences import TokenSequence


def tiny_target(seed: int = 0, vocab: int = 64, layers: int = 6, hidden: int = 32) -> Transformer:
    """`hidden` 64 (head dim 16) is the narrowest the C++ kernel takes (`engine/cpu/fused_decode.py`)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=hidden // 4, max_position=256, tie_word_embeddings=True)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for layer in model.layers:
            layer.input_norm.weight.fill_(1.0)
            layer.post_norm.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
    return model.eval()


def tiny_drafter(target: Transformer, block_size: int = 4, num_layers: int = 2, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig.for_target(target.config, num_layers, num_taps=3, block_size=block_size))
    with torch.no_grad():
        drafter.mask_embedding.normal_()
    return drafter.eval()


def greedy_outputs(target: Transformer, prompts: list[tuple[int, ...]], max_tokens: int) -> list[TokenSequence]:
    """The target's greedy answers to `prompts`, as stored training data holds them."""
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=64), ())
    out = engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [TokenSequence(p, tuple(s.output_ids)) for p, s in zip(prompts, out)]


def plain_and_speculative(model: Transformer, prompts: list[list[int]], proposer: Proposer, max_tokens: int,
                          max_len: int) -> tuple[list[list[int]], list[Sequence]]:
    """`model`'s greedy answers to `prompts` without speculation, and its sequences with `proposer`
    (one slot per prompt): a lossless proposer leaves the answers equal."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    config = EngineConfig(num_slots=len(prompts), max_len=max_len)
    plain = [s.output_ids for s in LLMEngine(model, config, []).generate(prompts, greedy)]
    return plain, LLMEngine(model, config, [], proposer=proposer).generate(prompts, greedy)
