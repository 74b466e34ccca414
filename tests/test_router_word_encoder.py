"""The router's WordEncoder against the tokenizers it stands in for (transformers' encode is the
oracle), and the router's chunk keys against the engines' hash functions."""

from __future__ import annotations

import json
import random
import string
import threading
from pathlib import Path
from typing import Any

import pytest

from chunkcache.hashing import chunk_hash, prompt_hashes, system_hash, to_wire
from chunkcache.router.tokens import CachedEncoder, PromptProcessor
from chunkcache.router.word_encoder import _LLAMA3, _QWEN2, WordEncoder
from tests.support.tiny_checkpoint import build_tokenizer

QWEN_LIKE = "/root/.cache/chunkcache/bench-qwen2.5-0.5b"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tests' byte-level BPE (GPT-2's split, a BOS added by its post-processor)."""
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def variant(tok: Any, **changes: Any) -> Any:
    """The same BPE vocabulary and merges with another pipeline (`tokenizer.json` fields)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    config = json.loads(tok.backend_tokenizer.to_str())
    config.update(changes)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(config)))


def split_then_bytes(regex: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def random_texts(seed: int, count: int) -> list[str]:
    """ASCII texts that stress the split: contractions in both cases, digit runs, whitespace runs
    of every kind before words and at the end, punctuation runs, control characters."""
    rng = random.Random(seed)
    pieces = [
        "'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'d", "'", "''", "don't", "I'm",
        " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\x0b", "\x0c", "\x00", "\x1f", "\x7f",
        "7", "42", "1234", "3.14", "-", "--", "...", "!?", "(", ")", "#", " # # ",
        "the", "The", "THE", "quick", "brown", "fox", "zxqv", "a", "I",
    ]  # fmt: skip
    texts = []
    for _ in range(count):
        n = rng.randint(0, 40)
        texts.append(
            "".join(
                rng.choice(pieces) if rng.random() < 0.7 else rng.choice(string.printable) for _ in range(n)
            )
        )
    return texts


def assert_same_ids(enc: WordEncoder, tok: Any, texts: list[str]) -> None:
    for text in texts:
        for special in (False, True):
            assert enc.encode(text, special) == list(tok.encode(text, add_special_tokens=special)), (
                text,
                special,
            )


def test_word_encoder_equals_the_tokenizer_on_ascii_text(tiny: Any) -> None:
    enc = WordEncoder.for_tokenizer(tiny)
    assert enc is not None
    assert enc._prefix == [tiny.bos_token_id] and enc._suffix == []
    texts = random_texts(0, 400)
    assert_same_ids(enc, tiny, texts)
    assert enc.fallbacks == 0  # every text above took the word path
    # Long text: words repeat, so the second time every pre-token comes from the cache.
    doc = " ".join(texts)
    learned = len(enc)
    assert enc.encode(doc, False) == tiny.encode(doc, add_special_tokens=False)
    assert len(enc) >= learned


@pytest.mark.parametrize("regex", [_LLAMA3, _QWEN2], ids=["llama3-split", "qwen2-split"])
def test_word_encoder_equals_the_tokenizer_for_split_then_byte_level(tiny: Any, regex: str) -> None:
    tok = variant(tiny, pre_tokenizer=split_then_bytes(regex), normalizer={"type": "NFC"})
    enc = WordEncoder.for_tokenizer(tok)
    assert enc is not None
    assert_same_ids(enc, tok, random_texts(1, 400))
    assert enc.fallbacks == 0


def _qwen_tokenizer() -> Any:
    """A real Qwen2.5 tokenizer: a checkpoint folder's where one is here, else the installed
    default model's (Qwen2.5-Coder-1.5B's GGUF, read as the router reads it); None without either."""
    if Path(QWEN_LIKE, "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(QWEN_LIKE)
    from chunkcache.model import catalog, fetch
    from chunkcache.model.gguf_tokenizer import load_gguf_tokenizer_without_torch

    qwen = catalog.QWEN_CODER_1_5B
    path = catalog.candidate_path(qwen)
    if path is None or not path.is_file() or not fetch.is_verified(qwen, path):
        return None
    return load_gguf_tokenizer_without_torch(path)


def test_word_encoder_equals_a_real_qwen_tokenizer() -> None:
    tok = _qwen_tokenizer()
    if tok is None:
        pytest.skip("no Qwen2.5 tokenizer here: the 1.5B (`chunkcache models --install qwen2.5-coder-1.5b`)")
    enc = WordEncoder.for_tokenizer(tok)
    assert enc is not None
    assert_same_ids(enc, tok, random_texts(2, 300))


def test_non_ascii_text_and_added_tokens_go_to_the_tokenizer(tiny: Any) -> None:
    enc = WordEncoder.for_tokenizer(tiny)
    assert enc is not None
    for text in ("café au lait", "naïve “quotes”", "<|im_start|>user\nhi<|im_end|>", f"x{tiny.bos_token}y"):
        assert enc.encode(text, False) == tiny.encode(text, add_special_tokens=False)
        assert enc.encode(text, True) == tiny.encode(text, add_special_tokens=True)
    assert enc.fallbacks == 8


def test_pipelines_it_cannot_reproduce_get_no_encoder(tiny: Any) -> None:
    byte_level = json.loads(tiny.backend_tokenizer.to_str())["pre_tokenizer"]
    assert (
        WordEncoder.for_tokenizer(variant(tiny, pre_tokenizer={**byte_level, "add_prefix_space": True}))
        is None
    )
    assert WordEncoder.for_tokenizer(variant(tiny, normalizer={"type": "Lowercase"})) is None
    assert WordEncoder.for_tokenizer(variant(tiny, pre_tokenizer=split_then_bytes(r"\s+|\S+"))) is None
    model = json.loads(tiny.backend_tokenizer.to_str())["model"]
    assert WordEncoder.for_tokenizer(variant(tiny, model={**model, "dropout": 0.1})) is None

    class NotATokenizersTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(w) for w in text.split()]

    assert WordEncoder.for_tokenizer(NotATokenizersTokenizer()) is None
    # The processor then uses the tokenizer itself.
    assert isinstance(PromptProcessor(NotATokenizersTokenizer(), "m").encoder, NotATokenizersTokenizer)


def test_the_word_cache_is_bounded_and_safe_across_threads(tiny: Any) -> None:
    enc = WordEncoder.for_tokenizer(tiny, capacity_words=50)
    assert enc is not None
    texts = random_texts(3, 200)
    errors: list[str] = []

    def work(part: list[str]) -> None:
        for text in part:
            if enc.encode(text, False) != tiny.encode(text, add_special_tokens=False):
                errors.append(text)

    threads = [threading.Thread(target=work, args=(texts[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(enc) <= 50 + max(len(set(enc._split(t))) for t in texts)


def test_processor_with_the_word_encoder_gives_the_tokenizers_ids(tiny: Any) -> None:
    fast, slow = PromptProcessor(tiny, "m"), PromptProcessor(tiny, "m", word_encoder=False)
    assert isinstance(fast.encoder, WordEncoder) and slow.encoder is tiny
    docs = [" ".join(random_texts(10 + d, 30)) for d in range(3)]
    chunked = " # # ".join(["You are terse.", *docs, "What is it?"])
    for prompt in (chunked, docs[0], "short plain prompt"):
        for rendered in (False, True):
            a, b = fast.tokenize(prompt, rendered), slow.tokenize(prompt, rendered)
            assert a == b
            assert fast.keys(a) == slow.keys(b)


def test_chunk_keys_equal_the_engines_hashes() -> None:
    sys_ids = tuple(range(5, 600, 3))
    chunks = [tuple(range(1, 40)), (70000, 3, 2**31, 23, 24, 255, 256, 65535, 65536), (0,)]
    for algorithm in ("sha256", "sha512"):
        for salt in (None, "tenant-a"):
            expected = [to_wire(system_hash("model-x", sys_ids, algorithm, salt))] + [
                to_wire(chunk_hash("model-x", sys_ids, c, algorithm, salt)) for c in chunks
            ]
            assert [
                to_wire(h) for h in prompt_hashes("model-x", sys_ids, chunks, algorithm, salt)
            ] == expected


def test_cache_aware_leaves_out_a_chunked_prompts_block_keys(tiny: Any) -> None:
    p = PromptProcessor(tiny, "m")
    doc = " ".join(random_texts(20, 40)).replace("#", "")  # no separator inside
    t = p.tokenize(" # # ".join(["system part " * 10, doc, doc[::-1], "q?"]))
    full, lean = p.keys(t), p.keys(t, chunked_block_keys=False)
    assert full.block_keys and lean.block_keys == []
    assert (full.chunk_keys, full.chunk_tokens, full.num_tokens) == (
        lean.chunk_keys,
        lean.chunk_tokens,
        lean.num_tokens,
    )
    plain = p.tokenize(doc)  # a plain prompt keeps its block keys: they are all it has
    assert p.keys(plain, chunked_block_keys=False).block_keys == p.keys(plain).block_keys != []
    # The remembered parts go through the word encoder too.
    assert isinstance(p.parts, CachedEncoder) and p.parts.tokenizer is p.encoder
