"""Generate tiny models with random weights, offline, for ``vllm serve`` on a CPU: dense, hybrid and draft models.

Run with the Python of the vLLM venv (it needs transformers, tokenizers and torch):
``python -m tests.real_vllm.tiny_models OUT_DIR`` (from the repository) writes one folder per model and prints
each folder's path on its own line. Nothing is downloaded: the tokenizer is trained
on a few sentences here, and the weights are random (``save_pretrained``), so the
models talk nonsense, but vLLM loads them, lays out their KV cache (attention, and
Mamba or linear-attention state for the hybrids) and answers requests.

Sizes are as small as vLLM's CPU backend allows: attention head sizes of 32 or more,
Qwen3-Next's linear-attention heads of 128; all weights in bfloat16, which Qwen3-Next
needs on the CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GraniteMoeHybridConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3NextConfig,
)

VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"
SENTENCES = [
    "The exporter shows the block sizes a vLLM engine really runs with.",
    "Hybrid models keep Mamba state beside their attention KV cache.",
    "A block holds the keys and values of a fixed number of tokens.",
    "Prometheus scrapes the metrics and Grafana draws them.",
    "Once upon a time a tiny model answered every prompt with noise.",
]
# Shared by all models: a small context keeps the KV cache and the start-up short.
COMMON = {"vocab_size": VOCAB_SIZE, "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 1}


def llama() -> PretrainedConfig:
    """Dense attention only: vLLM reports no Mamba block size."""
    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, **COMMON,
    )  # fmt: skip


def qwen3_next() -> PretrainedConfig:
    """Gated DeltaNet (linear attention, a Mamba-like state) beside full attention, with MoE layers.

    Two linear-attention key and value heads, so that each of two tensor-parallel workers has one.
    """
    return Qwen3NextConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"], **COMMON,
    )  # fmt: skip


def granite_moe_hybrid() -> PretrainedConfig:
    """Mamba2 layers beside attention (IBM Granite 4.0's architecture).

    The state is large enough that vLLM must raise the attention block beyond the CPU backend's 128.
    """
    return GraniteMoeHybridConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1,
        mamba_chunk_size=64, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, **COMMON,
    )  # fmt: skip


def qwen3_draft() -> PretrainedConfig:
    """A one-layer dense Qwen3 with Qwen3-Next's vocabulary and attention shape: a draft model for speculative decoding.

    Its attention layer has the target's page size, so vLLM puts it in the target's full-attention KV-cache group.
    """
    return Qwen3Config(
        hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, **COMMON,
    )  # fmt: skip


MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": llama,
    "qwen3-next": qwen3_next,
    "granite-moe-hybrid": granite_moe_hybrid,
    "qwen3-draft": qwen3_draft,
}


def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``SENTENCES``: any text encodes, nothing is fetched."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=EOS)


def generate(out_dir: Path) -> list[Path]:
    """Write every model (config, random bfloat16 weights, tokenizer) into its own folder of ``out_dir``."""
    torch.manual_seed(0)
    shared_tokenizer = tokenizer()
    folders = []
    for name, make_config in MODELS.items():
        folder = out_dir / name
        model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        shared_tokenizer.save_pretrained(folder)
        folders.append(folder)
    return folders


if __name__ == "__main__":
    for generated in generate(Path(sys.argv[1])):
        print(generated)
