"""A model directory a real vLLM can serve without a model hub: shape, tokenizer, chat template.

vLLM's ``--load-format dummy`` fills the weights with random values, so a directory needs only
``config.json`` (a ``Qwen3ForCausalLM`` shape), ``generation_config.json`` and the tokenizer
files. The tokenizer is a byte-level BPE trained here, in seconds, on the running Python's own
standard-library sources (sorted, the first ``TRAIN_BYTES``), with ChatML special tokens and a
ChatML ``chat_template``; the same shape and Python give the same directory, byte for byte.

Random weights emit random text and stop at a random EOS: send ``"ignore_eos": true`` when an
output length must be exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

TRAIN_BYTES = 4_000_000
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3 decoder's size. The default: 4 layers, hidden 512, ~16.8M parameters."""

    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    max_position_embeddings: int = 8192

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token over all layers (bf16 by default)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def parameters(self) -> int:
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q/k norms
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h  # tied embeddings

    def digest(self) -> str:
        blob = json.dumps([asdict(self), CHAT_TEMPLATE, TRAIN_BYTES, SPECIAL_TOKENS]).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# Named shapes: "tiny" serves the shipped cluster config and the tests; "small" (8 layers,
# hidden 1024, ~109M parameters, ~7x tiny's time per token) is for measurements where the
# engine step, not the server around it, should set the latency (closer to a GPU's regime).
SHAPES = {
    "tiny": ModelShape(),
    "small": ModelShape(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
    ),
}


def qwen3_config(shape: ModelShape) -> dict[str, object]:
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_hidden_layers,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": eos,
        "use_cache": True,
    }


def default_models_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "switchyard" / "vllm-models"


def training_files(limit_bytes: int = TRAIN_BYTES) -> list[Path]:
    """The standard library's ``.py`` files in sorted order, up to ``limit_bytes`` in all."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        out.append(path)
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return out


def train_tokenizer(vocab_size: int, files: list[Path]) -> str:
    """A byte-level BPE (GPT-2 style) trained on ``files``; its ``tokenizer.json`` text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return str(tok.to_str())


def make_model_dir(shape: ModelShape | None = None, root: Path | None = None) -> Path:
    """``<root>/qwen3-<digest>`` with everything ``vllm serve --load-format dummy`` reads;
    made once (a finished directory is reused), atomically (built beside it, then renamed)."""
    shape = shape or ModelShape()
    root = root or default_models_dir()
    target = root / f"qwen3-{shape.digest()}"
    if (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    eos = "<|im_end|>"
    files = {
        "config.json": qwen3_config(shape),
        "generation_config.json": {
            "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
            "eos_token_id": SPECIAL_TOKENS.index(eos),
        },
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
            "eos_token": eos,
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "unk_token": None,
            "add_bos_token": False,
            "model_max_length": shape.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": {"eos_token": eos, "pad_token": "<|endoftext|>"},
    }
    for name, body in files.items():
        (tmp / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    (tmp / "tokenizer.json").write_text(train_tokenizer(shape.vocab_size, training_files()))
    try:
        tmp.rename(target)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target
