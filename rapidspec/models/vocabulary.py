"""Vocabularies: compatibility of a target and a drafter (same token -> same id), a model's logit width and EOS ids."""

from __future__ import annotations

from typing import Any

from rapidspec.errors import RapidspecError


def vocab_compatible(target_tokenizer: Any, drafter_tokenizer: Any) -> bool:
    """True when both tokenizers map every token string to the same id.

    Only ``get_vocab()`` is compared, so models whose embedding matrices are
    padded to different sizes but share a tokenizer are compatible. Accepts
    tokenizers or :class:`LoadedModel` instances.
    """
    return _vocab(target_tokenizer) == _vocab(drafter_tokenizer)


def check_same_vocabulary(target_tokenizer: Any, drafter_tokenizer: Any) -> None:
    """Raise :class:`RapidspecError` unless the two vocabularies are identical."""
    target_vocab, drafter_vocab = _vocab(target_tokenizer), _vocab(drafter_tokenizer)
    if target_vocab == drafter_vocab:
        return
    only_target = len(target_vocab.keys() - drafter_vocab.keys())
    only_drafter = len(drafter_vocab.keys() - target_vocab.keys())
    moved = sum(1 for k in target_vocab.keys() & drafter_vocab.keys() if target_vocab[k] != drafter_vocab[k])
    raise RapidspecError(
        "the drafter's vocabulary differs from the target's "
        f"(target {len(target_vocab)} tokens, drafter {len(drafter_vocab)}; "
        f"{only_target} only in target, {only_drafter} only in drafter, {moved} with different ids): "
        "use a drafter with the same tokenizer"
    )


def _vocab(tokenizer_or_model: Any) -> dict[str, int]:
    # a LoadedModel carries its tokenizer; a tokenizer has no `.tokenizer`
    tokenizer = getattr(tokenizer_or_model, "tokenizer", tokenizer_or_model)
    return dict(tokenizer.get_vocab())


def logit_width(model: Any) -> int:
    """Number of logits per position of a transformers model (its output layer's width, padding included)."""
    head = model.get_output_embeddings()  # nn.Linear or a rapidspec.runtime.quantization low-bit layer
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def eos_token_ids(loaded: Any) -> frozenset[int]:
    """EOS ids of a :class:`LoadedModel`, from its generation config and its tokenizer."""
    ids: set[int] = set()
    generation_config = getattr(loaded.model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(t) for t in eos)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    return frozenset(ids)
