"""Tiny models built from configs, shared by the fast tests.

* ``byte_tokenizer``: a byte-level tokenizer (one token per byte, 256 + EOS),
  so any text works and token counts are predictable.
* ``tiny_model`` / ``make_tiny_model(seed)``: random 2-layer Llama models on
  that vocabulary (hidden 32, grouped-query attention 4/2 heads), as
  transformers' own assisted-generation tests use.
* ``MarkovLM``: a model whose next-token logits depend only on the last token,
  from a fixed table, so that exact output distributions can be computed.
* ``attention_choices_file``, ``step_costs_file`` (autouse): attention paths
  and step costs measured during the session are kept in temporary files, not
  in the user's cache directory.
* ``drafter_from_the_first_round``: tests of the rounds' math (invariants,
  distributions, the drafter backends) decode with ``drafter_start="first"``,
  the drafter in every round from the first; how it joins by default is
  tested in test_drafter_join.py and test_determinism.py.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from rapidspec.models import LoadedModel  # noqa: E402

EOS = "<eos>"


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS)


def make_tiny_model(seed: int = 0, tokenizer=None, max_context: int = 4096, hidden_size: int = 32) -> LoadedModel:
    tokenizer = tokenizer or build_byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"tiny-{seed}",
        device=model.device,
        dtype=model.dtype,
        max_context=max_context,
        source="config",
    )


@pytest.fixture(scope="session", autouse=True)
def embedding_store_folder(tmp_path_factory):
    """Chunk embeddings stored by tests go to a folder of this session, not the user's cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("embeddings")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAPIDSPEC_EMBEDDING_STORE", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def attention_choices_file(tmp_path_factory):
    """Attention paths measured by tests are kept in a file of this session, not the user's cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("attention") / "attention_paths.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAPIDSPEC_ATTENTION_PATHS", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def step_costs_file(tmp_path_factory):
    """Step costs calibrated by tests are kept in a file of this session, not the user's cache (subprocesses too)."""
    path = tmp_path_factory.mktemp("costs") / "step_costs.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAPIDSPEC_STEP_COSTS", str(path))
        yield path


@pytest.fixture
def drafter_from_the_first_round(monkeypatch):
    """Every generation of the test prepares its drafter before the first round (``drafter_start="first"``)."""
    from rapidspec import Rapid

    decode = Rapid.decode

    def first(self, prompts, config, **options):
        return decode(self, prompts, config.with_(drafter_start="first"), **options)

    monkeypatch.setattr(Rapid, "decode", first)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(byte_tokenizer):
    return make_tiny_model(0, byte_tokenizer)


@pytest.fixture(scope="session")
def other_tiny_model(byte_tokenizer):
    return make_tiny_model(1, byte_tokenizer)


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` in milliseconds (emoji/CJK = several tokens)."""
    from tokenizers import trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tmp_path_factory):
    """The tiny model saved as a local Hugging Face directory (for CLI commands run as users run them)."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    tiny_model.model.save_pretrained(path)
    tiny_model.tokenizer.save_pretrained(path)
    return path
