"""Memory of the served target by how it holds its weights, side by side in one run: SmolLM2-135M's
GGUF loaded as bf16 (`--weights dense`), from its own blocks (`gguf`, what `auto` serves on the CPU)
and as NVFP4 with the LM head (`nvfp4 --nvfp4-lm-head`).

Each format in a fresh process of its own (so that one's freed pages do not count to the next), all
less the same process before loading (torch, the kernels and the tokenizer libraries): its peak
resident set while loading (the file is read densely first); its resident set once loaded, after
glibc has returned freed pages (`malloc_trim`); and its peak, counted afresh from there, over a
256-token prefill and 64 decode steps at batch 1 with one KV-cache slot (where oneDNN has native
bf16, `gguf` prefill chunks multiply a matrix dequantized for the pass, then dropped:
`engine/model/gguf_linear.py`).

Writes `benchmarks/results/weights_memory.json` and prints a markdown table. Run:
`.venv/bin/python benchmarks/weights_memory.py`. Not a test: it asserts nothing.
"""

import argparse
import ctypes
import gc
import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "weights_memory.json"
FORMATS = {"bf16": ("dense", False), "gguf": ("gguf", False), "NVFP4 + LM head": ("nvfp4", True)}
PREFILL, DECODE = 256, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", choices=list(FORMATS), help=argparse.SUPPRESS)  # the child's own run
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one)))
        return
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
    from benchmarks.machine import describe

    rows = []
    for name in FORMATS:
        child = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, check=True)
        rows.append({"weights": name, **json.loads(child.stdout.strip().splitlines()[-1])})
        print(rows[-1], flush=True)
    args.out.write_text(json.dumps({"machine": describe(), "prefill_tokens": PREFILL, "decode_steps": DECODE,
                                    "formats": rows}, indent=2) + "\n")
    print("\n| weights | peak loading (MB) | resident once loaded (MB) | peak serving (MB) |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['weights']} | {r['peak_loading_mb']:.1f} | {r['resident_mb']:.1f} | {r['peak_serving_mb']:.1f} |")


def measure(name: str) -> dict[str, float]:
    """One format, in this process: MB at its peak loading, resident once loaded and at its peak
    serving, each less this process's resident set before loading."""
    import torch

    from specloop.engine.loaders.load import load_for_inference
    from specloop.engine.loaders.weight_format import WeightFormat
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.runtime.sequence import SamplingParams
    from specloop.kernels.cpu_decode import load as load_kernel

    load_kernel()  # the build is imported before the baseline: it is the same for every format
    base = _status_mb("VmRSS")
    kind, lm_head = FORMATS[name]
    loaded = load_for_inference(None, torch.bfloat16, torch.device("cpu"), WeightFormat(kind, lm_head))
    peak_loading = _status_mb("VmHWM")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    resident = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) counts afresh from here
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=1, max_len=PREFILL + DECODE + 8), ())
    prompt = torch.randint(100, 40000, (PREFILL,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=DECODE, temperature=0.0))
    return {"peak_loading_mb": round(peak_loading - base, 1), "resident_mb": round(resident - base, 1),
            "peak_serving_mb": round(_status_mb("VmHWM") - base, 1)}


def _status_mb(field: str) -> float:
    """A `/proc/self/status` memory field (kB there) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"/proc/self/status has no {field}")


if __name__ == "__main__":
    main()
