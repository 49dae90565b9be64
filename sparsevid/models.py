"""Loading a Video-LLM by name or folder through `from_pretrained` (never `trust_remote_code`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

from . import attention, kernels
from .adapters import Adapter, adapter_for
from .cache import BufferPool
from .errors import ModelError

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
EMBEDDED = os.path.join(ASSETS, "toy-qwen2vl")
EMBEDDED_NAME = "embedded"

MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
}

# Real checkpoints the app offers; they load only where the hub (or a local cache) is reachable.
KNOWN_CHECKPOINTS = [
    "Qwen/Qwen2-VL-2B-Instruct",
    "Qwen/Qwen2.5-VL-3B-Instruct",
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
]


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    adapter: Adapter
    name: str
    revision: str
    device: torch.device
    dtype: torch.dtype
    fast: object = None  # `fast.FastSteps` when compiled steps are enabled (`fast.enable`)
    pool: BufferPool | None = None  # CUDA: KV buffers kept between runs (`cache.BufferPool`)
    # CPU: the intra-op threads decode steps run on (`runs.choose_step_threads`; None: torch's count)
    step_threads: int | None = None
    # CPU: the threads of steps over a per-head layout (HT-Sparse, SparseMM: masks, scales, ragged heads;
    # `runs.compile_steps` chooses them where steps run on several); None: `step_threads`
    head_threads: int | None = None
    threads_note: str = ""  # how `step_threads` (and `head_threads`) were chosen, in words

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.text_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.text_config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        c = self.text_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def pick_device(device: str | None = None, dtype: str | torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA in bf16 when present, else CPU in float32; either overridable."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16}[dtype]
    return dev, dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def resolve(name_or_dir: str | None) -> str:
    if name_or_dir in (None, "", EMBEDDED_NAME):
        return EMBEDDED
    return name_or_dir


def load_model(name_or_dir: str | None = None, device: str | None = None, dtype=None) -> Loaded:
    """Load model, tokenizer and adapter. Raises ModelError with a readable message on failure."""
    path = resolve(name_or_dir)
    dev, dt = pick_device(device, dtype)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # offline hub, unknown repo, bad folder
        raise ModelError(f"Model '{name_or_dir}' could not be loaded ({type(e).__name__}); "
                         "real checkpoints need the Hugging Face hub or a local copy.") from None
    cls_name = MODEL_CLASSES.get(config.model_type)
    if cls_name is None:
        raise ModelError(f"Model type '{config.model_type}' is not supported; supported: "
                         f"{', '.join(sorted(MODEL_CLASSES))}.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = getattr(transformers, cls_name).from_pretrained(path, dtype=dt, attn_implementation="sdpa")
    except Exception as e:
        raise ModelError(f"Model '{name_or_dir}' could not be loaded: {type(e).__name__}: {e}".split("\n")[0]) from None
    model.to(dev).eval()
    if dev.type == "cpu" and dt == torch.float32:  # build (once per machine, ~15 s) or load the CPU decode attention
        kernels.cpu_available()
    model.set_attn_implementation({"text_config": attention.NAME})
    attention.install(model)  # the pruning pre-hooks (inactive unless a run prunes its prefill)
    adapter = adapter_for(path, config, tokenizer)
    revision = getattr(config, "_commit_hash", None) or "local"
    # CUDA: buffers kept between runs, so captured graphs replay across runs; the CPU's compiled steps
    # need no fixed addresses, and fresh buffers keep its resident-memory figures per run
    pool = BufferPool() if dev.type == "cuda" else None
    return Loaded(model, tokenizer, adapter, name_or_dir or EMBEDDED_NAME, revision, dev, dt, pool=pool)
